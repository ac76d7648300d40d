"""KV writes over NATS: one request per write, the payload raw, the KvWrite metadata in
NATS headers (KvWrite.headers()), decode's KvWriteAck (or a micro error) as the reply.

    tx = NatsKvTransport(rt, timeout_s=10.0)          # rt: a started ServiceRuntime
    ack = await tx.send(decode_instance, meta, payload)             # prefill
    await tx.listen(decode_instance, on_write)                      # decode

A write from the same host (shm_transport.py) carries a shared-memory handle in the
SHM_HEADER header instead of a payload: once the write is admitted, the listener copies
the bytes out of the segment its writer announced (announce(); shm.Segments).
The receiver registers a raw micro endpoint on subjects.decode_kv(instance_id) through the
runtime, so bad headers and a size or digest mismatch become BAD_MESSAGE replies (ContractError)
and a ServiceError raised by on_write reaches the sender as that ServiceError.
"""
from __future__ import annotations

from shared import subjects
from shared.contracts.common import Codec, ContractError, encode
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.service import ServiceRuntime, decode_reply

from .shm import Segments, ShmUnavailable
from .transport import Admit, OnWrite, receive
from .wire import HEADER_ROOM, Buffer

ACK = Codec(KvWriteAck)
SHM_HEADER = "Pdmesh-Shm"             # a same-host write: "segment:offset:length", no payload
SHM_REFUSED = "kv-shm-unavailable"    # decode cannot read that segment (shm_transport.py)


class NatsKvTransport:
    def __init__(self, rt: ServiceRuntime, timeout_s: float = 10.0):
        """timeout_s: how long send() waits for decode's answer."""
        self.rt = rt
        self.timeout_s = timeout_s
        self.closed = False
        self.segments: Segments | None = None     # same-host writers' segments (shm.py)
        self.announced: dict[str, str] = {}       # writer instance -> its segment's name

    @property
    def max_payload(self) -> int:
        """The connected server's max_payload less the room the headers need."""
        return self.rt.nc.max_payload - HEADER_ROOM

    async def send(self, dest: str, meta: KvWrite, payload: Buffer) -> KvWriteAck:
        return self.answer(await self.request(dest, meta, payload))

    async def request(self, dest: str, meta: KvWrite, payload: Buffer,
                      extra_headers: dict[str, str] | None = None):
        """The write as one NATS request; decode's reply message (answer() reads it)."""
        if self.closed:
            raise ConnectionError("KV transport closed")
        return await self.rt.nc.request(subjects.decode_kv(dest), payload,
                                        timeout=self.timeout_s,
                                        headers=meta.headers() | (extra_headers or {}))

    @staticmethod
    def answer(msg) -> KvWriteAck:
        """Decode's reply to a write: its ack, or the ServiceError it answered."""
        return decode_reply(msg.data, msg.headers, ACK)

    async def listen(self, instance_id: str, on_write: OnWrite,
                     admit: Admit | None = None) -> None:
        async def handler(req) -> bytes:
            meta = KvWrite.from_headers(req.headers)
            handle = req.headers.get(SHM_HEADER) if req.headers else None

            def read() -> Buffer:          # only once admitted (transport.receive)
                return req.data if handle is None else self._shm_region(meta.sender, handle)
            return encode(await receive(meta, read, on_write, admit))

        await self.rt.endpoint("kv", subjects.decode_kv(instance_id), handler, None, raw=True)
        await self.rt.nc.flush()        # the server knows the subscription: writes reach it

    def announce(self, writer: str, segment: str) -> None:
        """The segment a writer made (its heartbeat says): the only one read for it."""
        if segment:
            self.announced[writer] = segment
        else:
            self.announced.pop(writer, None)

    def _shm_region(self, writer: str, handle: str) -> memoryview:
        """A same-host write's bytes, from the segment its writer announced."""
        if self.announced.get(writer) != handle.split(":", 1)[0]:
            raise ContractError(f"{SHM_REFUSED}: not the segment {writer!r} announced")
        if self.segments is None:
            self.segments = Segments()
        try:
            return self.segments.region(handle)
        except ShmUnavailable as e:
            raise ContractError(f"{SHM_REFUSED}: {e}") from e

    async def close(self) -> None:
        """Stop sending; the endpoints (and the connection) belong to the runtime and end
        with rt.close()."""
        self.closed = True
