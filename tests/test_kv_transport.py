"""KV transports (shared/kv/): a write reaches the listener and its ack comes back, a refusal
reaches the sender as a ServiceError, a corrupted payload never reaches the listener; and
prefill's KvSender over the in-memory transport sends every piece of a job under the
write ledger, never more than `window` at once."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from services.prefill.ledger import Phase, WriteLedger
from services.prefill.sender import KvSender, Reclaimed
from shared import subjects
from shared.contracts.common import ErrorCode
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.contracts.messages import KvDestination, PrefillJob, SamplingParams
from shared.kv import wire
from shared.kv.faults import SlowKvTransport
from shared.kv.memory_transport import InMemoryKvTransport
from shared.service import ServiceError
from tests.gateway.conftest import nats_url  # noqa: F401 - the nats-server fixture

L, NB, BS, H, D = 4, 16, 4, 2, 8
LAYER_BYTES = 2 * BS * H * D * 4


def pool(seed=0):
    return torch.randn(L, 2, NB, BS, H, D, generator=torch.Generator().manual_seed(seed))


def write(kv, blocks, dest_blocks, seq=0, corrupt=False):
    payload, shape = wire.pack(kv, blocks, 0, L)
    meta = wire.signed(KvWrite(request_id="r1", epochs=[1] * len(blocks), block_ids=dest_blocks,
                               layer_start=0, layer_end=L, dtype="float32", shape=shape,
                               seq=seq, sender="p0", attempt="a1"), payload)
    if corrupt:
        meta = msgspec.structs.replace(meta, digest=("0" if meta.digest[0] != "0" else "1")
                                       + meta.digest[1:])
    return meta, payload


class Decode:
    """A listener that applies writes into its own pool."""

    def __init__(self):
        self.kv = torch.zeros(L, 2, NB, BS, H, D)
        self.writes: list[KvWrite] = []
        self.active = self.max_active = 0
        self.gate: asyncio.Event | None = None
        self.refuse_seq: int | None = None

    async def on_write(self, meta: KvWrite, payload: memoryview) -> KvWriteAck:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            for _ in range(3):                  # stay in flight a while
                await asyncio.sleep(0)
            if self.gate is not None:
                await self.gate.wait()
            if meta.seq == self.refuse_seq:
                raise ServiceError(ErrorCode.INVALID_REQUEST, "no such slot", meta.request_id)
            wire.unpack_into(self.kv, meta.block_ids, meta.layer_start, meta.layer_end,
                             payload, meta.dtype, meta.shape)
            self.writes.append(meta)
            return KvWriteAck(request_id=meta.request_id, seq=meta.seq, applied=True)
        finally:
            self.active -= 1


# ---- the in-memory transport -------------------------------------------------------------

async def test_write_reaches_listener_and_ack_returns():
    tx, dec, src = InMemoryKvTransport(), Decode(), pool()
    await tx.listen("d0", dec.on_write)
    meta, payload = write(src, [3, 7], [0, 5])
    ack = await tx.send("d0", meta, payload)
    assert ack == KvWriteAck(request_id="r1", seq=0, applied=True)
    assert dec.writes == [meta]
    assert torch.equal(dec.kv[:, :, [0, 5]], src[:, :, [3, 7]])


async def test_refusal_reaches_the_sender_as_service_error():
    tx, dec = InMemoryKvTransport(), Decode()
    dec.refuse_seq = 0
    await tx.listen("d0", dec.on_write)
    with pytest.raises(ServiceError) as e:
        await tx.send("d0", *write(pool(), [1], [1]))
    assert e.value.reply.code is ErrorCode.INVALID_REQUEST and e.value.reply.request_id == "r1"


async def test_digest_mismatch_never_reaches_the_listener():
    tx, dec = InMemoryKvTransport(), Decode()
    await tx.listen("d0", dec.on_write)
    with pytest.raises(ServiceError) as e:
        await tx.send("d0", *write(pool(), [1], [1], corrupt=True))
    assert e.value.reply.code is ErrorCode.BAD_MESSAGE and "digest" in str(e.value)
    assert dec.writes == [] and dec.max_active == 0


async def test_listener_crash_is_an_internal_error():
    tx = InMemoryKvTransport()

    async def crash(meta, payload):
        raise KeyError("boom")
    await tx.listen("d0", crash)
    with pytest.raises(ServiceError) as e:
        await tx.send("d0", *write(pool(), [1], [1]))
    assert e.value.reply.code is ErrorCode.INTERNAL


async def test_unknown_destination_and_closed_transport():
    tx, dec = InMemoryKvTransport(), Decode()
    await tx.listen("d0", dec.on_write)
    with pytest.raises(ConnectionError):
        await tx.send("d1", *write(pool(), [1], [1]))
    with pytest.raises(ValueError):
        await tx.listen("d0", dec.on_write)
    await tx.close()
    with pytest.raises(ConnectionError):
        await tx.send("d0", *write(pool(), [1], [1]))


async def test_payload_over_max_payload_is_refused():
    tx = InMemoryKvTransport(max_payload=100)
    await tx.listen("d0", Decode().on_write)
    with pytest.raises(ValueError, match="max_payload"):
        await tx.send("d0", *write(pool(), [1], [1]))


async def test_slow_transport_delays_and_delivers():
    inner, dec = InMemoryKvTransport(max_payload=12345), Decode()
    tx = SlowKvTransport(inner, max_delay_s=0.02, seed=1)
    assert tx.max_payload == 12345
    await tx.listen("d0", dec.on_write)
    t0 = asyncio.get_running_loop().time()
    acks = await asyncio.gather(*(tx.send("d0", *write(pool(), [i], [i], seq=i)) for i in range(5)))
    assert [a.seq for a in acks] == list(range(5)) and len(dec.writes) == 5
    assert asyncio.get_running_loop().time() - t0 < 1.0


# ---- KvSender + WriteLedger over the in-memory transport ---------------------------------

class Engine:
    """What KvSender reads from the prefill engine: the pool, a request's kept blocks and
    the chunk size (a prompt longer than one chunk is a link measurement)."""

    def __init__(self, blocks):
        self.kv = pool(seed=3)
        self.blocks = blocks
        self.cfg = type("Cfg", (), {"chunk_size": 512})()

    @property
    def port(self):                    # the engine's KvPort: only kept_blocks is read
        return self

    def kept_blocks(self, local_id):
        return list(self.blocks)


def job(dest_blocks, skip=0):
    return PrefillJob(request_id="r1", prompt_ids=list(range(40)), params=SamplingParams(),
                      tokenizer_fingerprint="fp", model="m", block_size=BS,
                      dest=KvDestination(instance_id="d0", block_ids=dest_blocks,
                                         epochs=[7] * len(dest_blocks), skip_blocks=skip))


def sender(tx, window=3, max_write_bytes=2 * LAYER_BYTES):
    led = WriteLedger()
    led.open("r1", "a1", "d0")
    assert led.granted("a1")
    return KvSender(tx, "p0", window, led, max_write_bytes), led


async def test_sender_sends_every_piece_within_the_window():
    tx, dec = InMemoryKvTransport(), Decode()
    await tx.listen("d0", dec.on_write)
    eng = Engine([9, 2, 11, 4, 0, 6])
    snd, led = sender(tx, window=3)
    dest = [1, 3, 5, 7, 9]                      # skip the first block: decode holds it
    issued, nbytes = await snd.send(job(dest, skip=1), eng, "local", "a1")
    pieces = wire.plan(len(dest), eng.kv, 2 * LAYER_BYTES)
    assert issued == len(pieces) == 10          # 2 layers of one block per write
    assert nbytes == len(dest) * L * LAYER_BYTES and snd.max_write_bytes == 2 * LAYER_BYTES
    assert dec.max_active == 3                  # the credit window, reached and honoured
    assert sorted(w.seq for w in dec.writes) == list(range(10))
    assert {w.attempt for w in dec.writes} == {"a1"} and {w.sender for w in dec.writes} == {"p0"}
    assert torch.equal(dec.kv[:, :, dest], eng.kv[:, :, [2, 11, 4, 0, 6]])
    e = led.get("a1")
    assert (e.issued, e.completed, e.failed, e.in_flight) == (10, 10, 0, 0)
    assert led.close("a1", 0.0).phase is Phase.DONE
    await asyncio.wait_for(snd.wait_idle("a1"), 1)


async def test_wait_idle_returns_once_writes_in_flight_end():
    tx, dec = InMemoryKvTransport(), Decode()
    dec.gate = asyncio.Event()
    await tx.listen("d0", dec.on_write)
    snd, led = sender(tx, window=2)
    sending = asyncio.ensure_future(snd.send(job([1, 2, 3]), Engine([4, 5, 6]), "local", "a1"))
    while dec.active < 2:
        await asyncio.sleep(0)
    led.cancel("a1")                            # a Reclaim: no new write starts
    idle = asyncio.ensure_future(snd.wait_idle("a1"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not idle.done() and led.get("a1").in_flight == 2
    dec.gate.set()
    await asyncio.wait_for(idle, 1)
    with pytest.raises(Reclaimed):
        await sending
    e = led.get("a1")
    assert (e.issued, e.completed, e.in_flight, e.phase) == (2, 2, 0, Phase.CANCELLED)
    assert len(dec.writes) == 2


async def test_refused_write_stops_the_attempt():
    tx, dec = InMemoryKvTransport(), Decode()
    dec.refuse_seq = 1
    await tx.listen("d0", dec.on_write)
    snd, led = sender(tx, window=1)
    with pytest.raises(RuntimeError, match="decode refused KV write 1"):
        await snd.send(job([1, 2, 3]), Engine([4, 5, 6]), "local", "a1")
    e = led.get("a1")
    # the refusal was an answer: completed, not failed; nothing issued after it
    assert (e.issued, e.completed, e.failed, e.phase) == (2, 2, 0, Phase.FAILED)


async def test_no_listener_is_a_failed_write():
    snd, led = sender(InMemoryKvTransport(), window=1)
    with pytest.raises(RuntimeError, match="KV write 0"):
        await snd.send(job([1, 2]), Engine([4, 5]), "local", "a1")
    e = led.get("a1")
    assert (e.issued, e.completed, e.failed, e.phase) == (1, 0, 1, Phase.FAILED)


# ---- the NATS transport, against a real nats-server --------------------------------------

async def _reachable(nc, subject: str, timeout_s: float = 10.0) -> None:
    """Until the server routes subject to the listener: a message without KV headers gets
    the listener's typed error back. A client that lost and regained its connection (seen
    once under a loaded full run) re-subscribes asynchronously; a write sent in between
    meets NoResponders, which is not what this test is about."""
    import nats.errors

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await nc.request(subject, b"", timeout=1.0)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_nats_transport_roundtrip(nats_url):  # noqa: F811 - the fixture
    from shared.kv.nats_transport import NatsKvTransport
    from shared.service import ServiceRuntime

    rt_dec = ServiceRuntime("decode", "d0", nats_url)
    rt_pre = ServiceRuntime("prefill", "p0", nats_url)
    await rt_dec.start()
    await rt_pre.start()
    try:
        rx, tx = NatsKvTransport(rt_dec), NatsKvTransport(rt_pre, timeout_s=30.0)
        dec = Decode()
        dec.refuse_seq = 9
        await rx.listen("d0", dec.on_write)
        await _reachable(rt_pre.nc, subjects.decode_kv("d0"))
        assert tx.max_payload == rt_pre.nc.max_payload - wire.HEADER_ROOM
        src = pool()
        meta, payload = write(src, [3, 7], [0, 5])
        assert await tx.send("d0", meta, payload) == KvWriteAck(request_id="r1", seq=0,
                                                                applied=True)
        assert dec.writes == [meta] and torch.equal(dec.kv[:, :, [0, 5]], src[:, :, [3, 7]])
        with pytest.raises(ServiceError) as e:
            await tx.send("d0", *write(src, [1], [1], corrupt=True))
        assert e.value.reply.code is ErrorCode.BAD_MESSAGE
        with pytest.raises(ServiceError) as e:
            await tx.send("d0", *write(src, [1], [1], seq=9))
        assert e.value.reply.code is ErrorCode.INVALID_REQUEST
        assert len(dec.writes) == 1
        # KvSender over NATS, end to end
        snd, led = sender(tx, window=2)
        issued, _ = await snd.send(job([1, 2, 3]), Engine([4, 5, 6]), "local", "a1")
        assert issued == 6 and led.get("a1").completed == 6
        with pytest.raises(Exception):          # nobody listens there
            await tx.send("d1", meta, payload)
    finally:
        await rt_pre.close()
        await rt_dec.close()
