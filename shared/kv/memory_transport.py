"""KV writes inside one process: no server, no subprocess, no sleeps (tests).

One InMemoryKvTransport is the hub both sides share: listen() registers on_write under an
instance id, send() calls it directly and returns its ack. It behaves like the NATS
transport where the protocol can tell: the metadata makes the round trip through its
headers, the admission, size and digest checks run in the same order (transport.receive),
a refusal (ServiceError) reaches the sender as a ServiceError, bad metadata or a size or
digest mismatch as ServiceError(BAD_MESSAGE), any other
failure of on_write as ServiceError(INTERNAL); an unknown destination raises
ConnectionError (nobody answered). Each send yields to the event loop once first, so
concurrent writes really are in flight together.
"""
from __future__ import annotations

import asyncio
import logging

from shared.contracts.common import ContractError, ErrorCode
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.service import ServiceError

from .transport import Admit, OnWrite, receive
from .wire import Buffer

log = logging.getLogger("pdmesh.kv")


class InMemoryKvTransport:
    def __init__(self, max_payload: int = 8 << 20, hub: dict[str, OnWrite] | None = None):
        """hub: share one listener table between several transports (default: its own)."""
        self.max_payload = max_payload
        self.hub: dict[str, tuple[OnWrite, Admit | None]] = {} if hub is None else hub
        self.mine: set[str] = set()
        self.closed = False
        self.sent = 0

    async def send(self, dest: str, meta: KvWrite, payload: Buffer) -> KvWriteAck:
        if self.closed:
            raise ConnectionError("KV transport closed")
        data = memoryview(payload).cast("B").toreadonly()
        if len(data) > self.max_payload:
            raise ValueError(f"KV payload {len(data)} B > max_payload {self.max_payload}")
        await asyncio.sleep(0)                    # the write is in flight
        listener = self.hub.get(dest)
        if listener is None:
            raise ConnectionError(f"no KV listener for {dest!r}")
        self.sent += 1
        try:
            meta = KvWrite.from_headers(meta.headers())
            return await receive(meta, lambda: data, *listener)
        except ServiceError:
            raise
        except ContractError as e:
            raise ServiceError(ErrorCode.BAD_MESSAGE, str(e)) from e
        except Exception as e:  # noqa: BLE001 - as the NATS endpoint answers a crash
            log.exception("KV on_write for %s failed", dest)
            raise ServiceError(ErrorCode.INTERNAL, repr(e)) from e

    async def listen(self, instance_id: str, on_write: OnWrite,
                     admit: Admit | None = None) -> None:
        if instance_id in self.hub:
            raise ValueError(f"{instance_id!r} already listens")
        self.hub[instance_id] = (on_write, admit)
        self.mine.add(instance_id)

    async def close(self) -> None:
        """Forget the listeners registered here; later sends raise ConnectionError."""
        for iid in self.mine:
            self.hub.pop(iid, None)
        self.mine.clear()
        self.closed = True
