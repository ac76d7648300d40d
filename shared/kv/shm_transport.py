"""KV writes through shared memory when prefill and decode share a host; NATS otherwise.

    tx = await ShmKvTransport.create(NatsKvTransport(rt, timeout_s), size_bytes=256 << 20)
    buf = tx.alloc(dest, nbytes)        # a region of this process's segment, or None
    payload, shape = wire.pack(kv, blocks, l0, l1, out=buf)     # gathered straight into it
    ack = await tx.send(dest, meta, payload)

Which decode instances share the host: their heartbeats say (Heartbeat.host, compared with
shm.host_id()). For those, alloc() hands out a region of the segment (shm.py) and send()
publishes the write on the same NATS subject as ever, with the same KvWrite headers (the
checksum, the block ids and their epochs) plus the region's handle, and no payload.
Decode's listener (NatsKvTransport.listen) reads the bytes in place, checks the checksum
and hands them to the same on_write: the epoch fence, the owner check and the request
table's write counts are exactly those of a NATS write, and so is the ack.

A region is freed once its write was answered (applied, fenced or refused); a write that
went unanswered may still be read, so its region is never reused (retired). When decode
cannot open the segment (another /dev/shm after all), it refuses with SHM_REFUSED: that
write is sent again over NATS, and so is every later one to that instance for RETRY_S.
No host, a full segment or `enabled=False` (prefill's --no-kv-shm): NATS. Decode reads
only the segment a writer announced in its heartbeat (Heartbeat.shm_segment), and
copies each region out of it (shm.Segments).
"""
from __future__ import annotations

import logging
import time
import weakref

from shared import subjects
from shared.contracts.common import Codec
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.contracts.messages import Heartbeat
from shared.service import ServiceError

from .nats_transport import SHM_HEADER, SHM_REFUSED, NatsKvTransport
from .shm import Arena, ShmUnavailable, host_id, sweep_dead
from .wire import Buffer

log = logging.getLogger("pdmesh.kv")
HEARTBEAT = Codec(Heartbeat)
RETRY_S = 30.0          # a decode that refused the segment is tried again after this


class ShmKvTransport:
    def __init__(self, inner: NatsKvTransport, size_bytes: int = 256 << 20,
                 enabled: bool = True, host: str | None = None):
        self.inner, self.rt = inner, inner.rt
        self.host = host_id() if host is None else host
        self.size = size_bytes
        self.enabled = enabled and bool(self.host)
        self.hosts: dict[str, str] = {}          # decode instance -> its host (heartbeats)
        self.refused: dict[str, float] = {}     # decode instance -> when it refused
        self.arena: Arena | None = None
        self._regions: dict[int, tuple[memoryview, int]] = {}
        self.counters = {"kv_shm_writes": 0, "kv_shm_bytes": 0, "kv_shm_fallbacks": 0,
                         "kv_shm_retired": 0}

    @classmethod
    async def create(cls, inner: NatsKvTransport, **kw) -> "ShmKvTransport":
        """The segment is made now, so the first heartbeat announces it (decode reads
        only announced segments)."""
        tx = cls(inner, **kw)
        if tx.enabled and tx._arena() is not None:
            await tx.rt.nc.subscribe(subjects.heartbeat("decode"), cb=tx._on_heartbeat)
        return tx

    @property
    def segment(self) -> str:
        """The segment's name, for this writer's heartbeat ("" when off)."""
        return self.arena.name if self.enabled and self.arena is not None else ""

    def _arena(self):
        if self.arena is None:
            try:
                sweep_dead()
                self.arena = Arena(self.size)
            except ShmUnavailable as e:
                log.warning("shared-memory KV off: %s", e)
                self.enabled = False
                return None
            weakref.finalize(self, self.arena.path.unlink, missing_ok=True)
        return self.arena

    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = HEARTBEAT.decode(msg.data)
        except Exception:  # noqa: BLE001 - not ours to judge
            return
        self.hosts[hb.instance_id] = hb.host

    @property
    def max_payload(self) -> int:
        return self.inner.max_payload

    def same_host(self, dest: str) -> bool:
        refused = self.refused.get(dest)
        if refused is not None and time.monotonic() - refused > RETRY_S:
            del self.refused[dest]         # it may have heard our heartbeat by now
            refused = None
        return self.enabled and refused is None and self.hosts.get(dest) == self.host

    def alloc(self, dest: str, nbytes: int) -> memoryview | None:
        """A writable region for a write to dest, or None (send it over NATS)."""
        if not self.same_host(dest) or self._arena() is None:
            return None
        off = self.arena.alloc(nbytes)
        if off is None:
            self.counters["kv_shm_fallbacks"] += 1
            return None
        view = self.arena.view[off:off + nbytes]
        self._regions[id(view)] = (view, off)
        return view

    def release(self, buf: memoryview) -> None:
        """A region alloc() gave that will not be sent (its packing failed)."""
        reg = self._regions.pop(id(buf), None)
        if reg is not None and reg[0] is buf:
            self.arena.free(reg[1])

    async def send(self, dest: str, meta: KvWrite, payload: Buffer) -> KvWriteAck:
        reg = self._regions.pop(id(payload), None)
        if reg is None or reg[0] is not payload:
            return await self.inner.send(dest, meta, payload)
        off = reg[1]
        if self.inner.closed:
            self.arena.free(off)
            raise ConnectionError("KV transport closed")
        handle = f"{self.arena.name}:{off}:{len(payload)}"
        try:
            msg = await self.inner.request(dest, meta, b"", {SHM_HEADER: handle})
        except Exception:
            self.counters["kv_shm_retired"] += 1      # it may still be read: never reused
            raise
        try:
            ack = self.inner.answer(msg)
        except ServiceError as e:
            if SHM_REFUSED not in str(e):
                self.arena.free(off)
                raise
            data = bytes(payload)
            self.arena.free(off)
            log.warning("decode %s cannot read shared memory (%s): NATS from now on", dest, e)
            self.refused[dest] = time.monotonic()
            self.counters["kv_shm_fallbacks"] += 1
            return await self.inner.send(dest, meta, data)
        self.arena.free(off)
        self.counters["kv_shm_writes"] += 1
        self.counters["kv_shm_bytes"] += len(payload)
        return ack

    async def listen(self, instance_id: str, on_write, admit=None) -> None:
        await self.inner.listen(instance_id, on_write, admit)

    async def close(self) -> None:
        await self.inner.close()
        if self.arena is not None:
            self.arena.close()
