"""The KV transport: how one prefill attempt's KV writes reach a decode instance.

In the spirit of vLLM's KVConnectorBase_V1 and SGLang's BaseKVSender/BaseKVReceiver, the
protocol above it (claims, the write ledger, reclaim-acks, epoch fences) does not care
how bytes move. A transport moves one write at a time:

    sender side   await transport.send(dest_instance, meta, payload) -> KvWriteAck
                  (raises ServiceError when decode refused the write, any other
                  exception when the write may or may not have landed: no answer)
    receiver side await transport.listen(instance_id, on_write, admit)
                  on_write(meta, payload) -> KvWriteAck; raise ServiceError to refuse
                  admit(meta) -> bool, asked before a byte of the write is read

Every receiver keeps one order (receive()): admit on the header alone (decode's owner
check and epoch fence: a write that may not land is answered without reading its bytes,
so nobody can make decode read, hash or map anything with a write it would refuse), then
the size the header announces, then the digest over header and payload, then on_write.
    both          await transport.close()

Completion, polling and wait-until-idle live one level up, where the counts are: the
sender's WriteLedger (services/prefill/ledger.py, KvSender.wait_idle) and decode's request
table (services/decode/lifecycle.py). Implementations: NatsKvTransport (the default) and
InMemoryKvTransport (in-process tests: no server, no subprocess, no sleeps); faults are
wrappers (shared/kv/faults.py: SlowKvTransport). The bytes: shared/kv/wire.py.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.contracts.common import ContractError
from shared.contracts.kv import KvWrite, KvWriteAck

from .wire import Buffer, digest_async, write_bytes

OnWrite = Callable[[KvWrite, memoryview | None], Awaitable[KvWriteAck]]
Admit = Callable[[KvWrite], bool]
REFUSED = "KV write refused"       # what a refused write is told, and no more


async def receive(meta: KvWrite, read: Callable[[], Buffer], on_write: OnWrite,
                  admit: Admit | None) -> KvWriteAck:
    """One received write, checked in order (see above). A write admit() refuses reaches
    on_write with no payload (counted there, never applied). ContractError when the bytes
    do not match the header (size or digest): the caller answers BAD_MESSAGE."""
    if admit is not None and not admit(meta):
        return await on_write(meta, None)
    try:
        expected = write_bytes(meta)
    except ValueError as e:
        raise ContractError(f"{REFUSED}: {e}") from e
    data = read()
    if len(data) != expected:
        raise ContractError(f"{REFUSED}: {len(data)} B, its header says {expected}")
    if await digest_async(meta, data) != meta.digest:
        raise ContractError(f"{REFUSED}: digest mismatch")
    return await on_write(meta, memoryview(data))


class KvTransport(Protocol):
    max_payload: int          # largest payload one write may carry, in bytes

    async def send(self, dest: str, meta: KvWrite, payload) -> KvWriteAck: ...

    async def listen(self, instance_id: str, on_write: OnWrite,
                     admit: Admit | None = None) -> None: ...

    async def close(self) -> None: ...
