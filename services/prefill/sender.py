"""Sending one job attempt's KV blocks to its decode instance, with credit-based flow
control, under the write ledger.

Each write carries kv[l0:l1, :, blocks] as raw bytes (shared/kv/wire.py) over a KV
transport (shared/kv/transport.py: NATS by default); decode's ack is the credit. At most
`window` writes are unacknowledged, so the bytes queued for decode stay bounded (window x
max_payload) whatever the sender's speed. Writes are sized to the transport's max_payload
(or less).

Layer-wise streaming (stream.py; mode "auto" chooses it per job from the measured link
and compute rates, linkcost.py; "on" always, "off" never; only prompts over one chunk):
open() before the prompt computes, and each layer's KV of each chunk goes out as soon as
the forward has written it, while the later layers compute; send() after the compute
writes what is left (the last layers, and prompt blocks prefill did not compute: its own
prefix-cache hits). Without open(), send() writes every block after the compute.

Writes across the network are at most NET_WRITE_BYTES (unless max_write_bytes says
otherwise): a smaller write pipelines the pack, the server's store-and-forward and
decode's apply with the wire (8 MiB writes used 53% of a 1 Gbit/s link, 2 MiB 92%);
writes through same-host shared memory go up to max_payload.

Before each write the ledger is asked whether the attempt may still write: after a
Reclaim (or a failed write) no new write starts, and send() returns only when every
write it started has completed, so the count it leaves in the ledger is final.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from shared.contracts.kv import KvWrite
from shared.contracts.messages import PrefillDone, PrefillJob
from shared.kv import wire
from shared.kv.transport import KvTransport
from shared.service import ServiceError

from .ledger import Phase, WriteLedger
from .linkcost import LinkMeter
from .stream import LayerStream

NET_WRITE_BYTES = 2 << 20
STREAM_MODES = ("auto", "on", "off")


class Reclaimed(Exception):
    """The attempt was reclaimed by decode: it stopped writing."""


class KvSender:
    def __init__(self, transport: KvTransport, sender_id: str, window: int,
                 ledger: WriteLedger, max_write_bytes: int = 0, stream: str = "auto",
                 stream_shm: bool = False, stream_min_share: float = 0.05):
        """max_write_bytes: 0 = NET_WRITE_BYTES across the network, the transport's
        max_payload through shared memory. stream: auto | on | off. The ack timeout is the
        transport's; a slow wire for tests is shared.kv.faults.SlowKvTransport."""
        if stream not in STREAM_MODES:
            raise ValueError(f"kv_stream must be one of {STREAM_MODES}, got {stream!r}")
        self.transport = transport
        self.sender_id = sender_id
        self.window = window
        self.ledger = ledger
        self.limit = max_write_bytes
        self.stream_mode = stream
        self.stream_min_share = stream_min_share
        self.meter = LinkMeter()            # measured link and compute rates (auto)
        self.choices: dict[str, str] = {}   # decode instance -> auto's last choice, and why
        self.stream_shm = stream_shm        # stream to a same-host decode (shared memory) too
        self.max_write_bytes = 0        # the largest payload sent so far (for STATS)
        self.changed = asyncio.Condition()   # a write of some attempt completed
        self.streams: dict[str, LayerStream] = {}    # engine request id -> its stream
        self.counters = {"kv_writes_streamed": 0, "kv_bytes_streamed": 0, "kv_done_in_write": 0,
                         "kv_jobs_streamed": 0, "kv_jobs_whole": 0}
        self.done_landed: set[str] = set()   # attempts whose one write carried PrefillDone

    def stats(self) -> dict:
        return (self.counters | getattr(self.transport, "counters", {})
                | {"kv_link_bytes_per_s": self.meter.report(), "kv_stream_choice": self.choices})

    def _same_host(self, dest: str) -> bool:
        same_host = getattr(self.transport, "same_host", None)
        return same_host is not None and same_host(dest)

    def max_bytes(self, dest: str) -> int:
        """The largest payload of one write to `dest`."""
        m = self.transport.max_payload
        if self.limit:
            return min(m, self.limit)
        return m if self._same_host(dest) else min(m, NET_WRITE_BYTES)

    # ---- layer-wise streaming ---------------------------------------------------------
    def will_stream(self, job: PrefillJob, engine) -> bool:
        """Whether open() streams this job's KV (asked once per attempt, before open()).
        A prompt of one chunk is not streamed: its forward is short, and waking the event
        loop at every layer costs the forward more (the GIL) than the overlap gains; its
        KV goes in one write after it. Nor to a decode on this host through shared memory
        (unless stream_shm): no wire time to hide there, the layer writes only cost.
        Otherwise "auto" asks the link meter (linkcost.py)."""
        dest = job.dest.instance_id
        if (self.stream_mode == "off" or len(job.prompt_ids) <= engine.cfg.chunk_size
                or (self._same_host(dest) and not self.stream_shm)):
            return False
        if self.stream_mode == "on":
            return True
        skip = job.dest.skip_blocks * engine.cfg.block_size
        nbytes = len(job.dest.block_ids) * wire.layer_bytes(engine.kv) * engine.kv.shape[0]
        stream, why = self.meter.choose(dest, len(job.prompt_ids) - skip, nbytes,
                                        self.stream_min_share)
        self.counters["kv_jobs_streamed" if stream else "kv_jobs_whole"] += 1
        self.choices[dest] = f"{'stream' if stream else 'whole'} ({why})"
        return stream

    def computed(self, job: PrefillJob, engine, tier: int, seconds: float) -> None:
        """The job's prompt computed in `seconds` (tier: leading blocks kvstore had)."""
        self.meter.computed(len(job.prompt_ids) - tier * engine.cfg.block_size, seconds)

    def open(self, job: PrefillJob, engine, local_id: str, attempt: str) -> None:
        """Stream the attempt's KV while engine request `local_id` computes (call before
        it is added to the engine, once will_stream() said so)."""
        engine.model.layer_listener = self._on_layer
        st = LayerStream(self, job, engine, local_id, attempt, asyncio.get_running_loop())
        self.streams[local_id] = st
        st.task = asyncio.ensure_future(st.pump())
        st.task.add_done_callback(lambda _: self.streams.pop(local_id, None))

    def drop(self, local_id: str) -> None:
        """The attempt is over: a stream still waiting (its compute failed, or a Reclaim
        came before the send) stops; writes it started finish under the ledger."""
        st = self.streams.pop(local_id, None)
        if st is not None and st.task is not None:
            st.task.cancel()

    def _on_layer(self, layer: int, meta) -> None:
        """The engine thread: a layer of this forward is in the pool."""
        for s in meta.spans:
            st = self.streams.get(s.request_id)
            if st is not None:
                st.computed(layer, s.context_len - s.n, s.context_len)

    # ---- sending ------------------------------------------------------------------------
    async def send(self, job: PrefillJob, engine, local_id: str, attempt: str,
                   final: Callable[[int, int], PrefillDone] | None = None) -> tuple[int, int]:
        """Write every prompt block not written yet; returns (writes issued, bytes). Raises
        Reclaimed if a Reclaim stopped the attempt, RuntimeError if a write failed or was
        refused; in every case only once no write of the attempt is in flight.

        final(writes, bytes): the attempt's PrefillDone. When the whole KV goes in one
        write (a short prompt, not streamed) that write carries it, and decode starts the
        request on it: one message instead of a write, its ack, then a PrefillDone.
        delivered_done(attempt) then says whether decode applied it (else the caller
        sends the PrefillDone as usual)."""
        st = self.streams.get(local_id)
        if st is not None:
            errors, total = await st.finish()
        else:
            errors, total = await self._send_all(job, engine, local_id, attempt, final)
        e = self.ledger.get(attempt)
        if e.phase is Phase.CANCELLED:
            raise Reclaimed(f"{job.request_id}: reclaimed after {e.issued} writes")
        if errors:
            raise RuntimeError("; ".join(errors[:3]))
        return e.issued, total

    def delivered_done(self, attempt: str) -> bool:
        """Whether the attempt's only write carried its PrefillDone and decode applied
        it (asked once, after send())."""
        if attempt in self.done_landed:
            self.done_landed.discard(attempt)
            return True
        return False

    async def _send_all(self, job, engine, local_id, attempt, final=None) -> tuple[list[str], int]:
        src = self.source_blocks(job, engine, local_id)
        pieces = wire.plan(len(src), engine.kv, self.max_bytes(job.dest.instance_id))
        measure = len(job.prompt_ids) > engine.cfg.chunk_size    # a link measurement (auto)
        if final is not None and len(pieces) == 1:
            errors: list[str] = []
            nbytes = wire.piece_bytes(engine.kv, len(src), pieces[0].l0, pieces[0].l1)
            n = await self.write(job, engine, attempt, src, pieces[0], errors,
                                 done=final(1, nbytes), measure=measure)
            return errors, n
        credits = asyncio.Semaphore(self.window)
        errors = []
        sizes: list[int] = []

        async def one(p: wire.Piece) -> None:
            async with credits:
                n = await self.write(job, engine, attempt, src, p, errors, measure=measure)
                sizes.append(n)

        await asyncio.gather(*(one(p) for p in pieces))
        return errors, sum(sizes)

    @staticmethod
    def source_blocks(job: PrefillJob, engine, local_id: str) -> list[int]:
        skip = job.dest.skip_blocks
        src = engine.port.kept_blocks(local_id)[skip:skip + len(job.dest.block_ids)]
        if len(src) != len(job.dest.block_ids):
            raise RuntimeError(f"prefill holds {len(src)} blocks, "
                               f"job wants {len(job.dest.block_ids)}")
        return src

    async def write(self, job: PrefillJob, engine, attempt: str, src: list[int],
                    p: wire.Piece, errors: list[str], done: PrefillDone | None = None,
                    measure: bool = False) -> int:
        """One write: blocks p.b0..p.b1 of the job's destination (src: this pool's blocks
        for them), layers p.l0..p.l1. Returns the bytes sent (0: not sent). done: the
        attempt's PrefillDone, carried by its only write. measure: the link meter times it
        (a write of a whole-prompt transfer)."""
        ledger = self.ledger
        if not ledger.may_issue(attempt):
            return 0
        dest = job.dest.instance_id
        alloc = getattr(self.transport, "alloc", None)     # a same-host shared-memory region
        buf = None
        try:
            nbytes = wire.piece_bytes(engine.kv, p.b1 - p.b0, p.l0, p.l1)
            buf = alloc(dest, nbytes) if alloc else None
            payload, shape = wire.pack(engine.kv, src[p.b0:p.b1], p.l0, p.l1, out=buf)
        except Exception as e:  # noqa: BLE001 - never a silent hole in the KV: the attempt fails
            if buf is not None:
                self.transport.release(buf)
            errors.append(f"KV write {p.index}: not packed: {e!r}")
            ledger.stop(attempt)
            return 0
        ledger.issue(attempt)         # counted before the first await: a Reclaim waits for it
        answered, sent = False, 0
        try:
            meta = KvWrite(request_id=job.request_id, epochs=job.dest.epochs[p.b0:p.b1],
                           block_ids=job.dest.block_ids[p.b0:p.b1], layer_start=p.l0,
                           layer_end=p.l1, dtype=wire.dtype_name(engine.kv.dtype), shape=shape,
                           seq=p.index, sender=self.sender_id, attempt=attempt, done=done)
            meta = msgspec.structs.replace(meta, digest=await wire.digest_async(meta, payload))
            ack = await self._send(dest, meta, payload, measure)
            answered, sent = True, len(payload)
            self.max_write_bytes = max(self.max_write_bytes, sent)
            if not ack.applied:
                errors.append(f"decode discarded KV write {p.index} (fenced)")
                ledger.stop(attempt)
            elif done is not None:
                self.done_landed.add(attempt)
                self.counters["kv_done_in_write"] += 1
        except ServiceError as e:    # an answer: decode refused the write
            answered = True
            errors.append(f"decode refused KV write {p.index}: {e}")
            ledger.stop(attempt)
        except Exception as e:  # noqa: BLE001 - timeout, connection: may still land
            errors.append(f"KV write {p.index}: {e!r}")
            ledger.stop(attempt)
        finally:
            ledger.complete(attempt, answered)
            async with self.changed:
                self.changed.notify_all()
        return sent

    async def _send(self, dest: str, meta: KvWrite, payload, measure: bool):
        if not measure:
            return await self.transport.send(dest, meta, payload)
        self.meter.begin(dest, time.monotonic())
        acked = 0
        try:
            ack = await self.transport.send(dest, meta, payload)
            acked = len(payload)
            return ack
        finally:
            self.meter.end(dest, acked, time.monotonic())

    async def wait_idle(self, attempt: str) -> None:
        """Until no write of the attempt is in flight."""
        e = self.ledger.get(attempt)
        if e is None:
            return
        async with self.changed:
            await self.changed.wait_for(lambda: e.in_flight == 0)
