"""Layer-wise KV streaming: one attempt's KV leaves while its prompt still computes.

The model calls a layer listener in the forward's thread once layer l of a forward is in
the pool (Model.layer_listener); for a prompt chunk that means layer l of every block the
chunk completed is final. computed() records that (done[l]: how many leading blocks of the
engine sequence are final at layer l) and wakes pump() on the event loop, which sends
rectangles of blocks x layers as credits allow: the oldest unsent blocks at the lowest
layer that has them, and every following layer at which exactly those blocks are final
and unsent. With credits to spare, each layer of each chunk goes alone, as soon as computed;
when decode acks slowly, the ready layers coalesce into fewer, larger writes.

A block a chunk only partly fills goes with the chunk that completes it (the prompt's
last block with the last chunk). Blocks decode wants that prefill did not compute (its
own prefix-cache hits) go after the compute, with the rest (finish()). Every write is a
KvSender.write: the ledger decides whether it may start, and counts it, exactly like a
write of a whole-prompt send; after a Reclaim or a failed write the pump issues nothing
more and ends once its writes in flight have.
"""
from __future__ import annotations

import asyncio
import logging

from shared.kv import wire

log = logging.getLogger("pdmesh.prefill")


class LayerStream:
    def __init__(self, sender, job, engine, local_id: str, attempt: str, loop):
        self.sender, self.job, self.engine = sender, job, engine
        self.local_id, self.attempt, self.loop = local_id, attempt, loop
        self.L = engine.kv.shape[0]
        self.bs = engine.cfg.block_size
        self.skip = job.dest.skip_blocks
        self.end = self.skip + len(job.dest.block_ids)   # engine block indices [skip, end)
        self.prompt_len = len(job.prompt_ids)
        self.max_bytes = sender.max_bytes(job.dest.instance_id)
        self.first: int | None = None    # first engine block this prefill computed
        self.done = [0] * self.L         # leading blocks final at each layer
        self.sent = [0] * self.L         # leading blocks sent (or not ours to send)
        self.finished = False
        self.wake = asyncio.Event()
        self.errors: list[str] = []
        self.bytes = 0
        self.index = 0
        self.task: asyncio.Task | None = None

    # ---- the engine thread ------------------------------------------------------------
    def computed(self, layer: int, start: int, ctx_end: int) -> None:
        """Layer `layer` of prompt positions [start, ctx_end) is in the pool."""
        if self.first is None:
            self.first = start // self.bs
            self.sent = [max(self.skip, self.first)] * self.L
        full = ctx_end // self.bs if ctx_end < self.prompt_len else -(-ctx_end // self.bs)
        self.done[layer] = max(self.done[layer], min(full, self.end))
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:        # the loop is closed (shutting down): nobody sends now
            pass

    # ---- the event loop ---------------------------------------------------------------
    def next_piece(self) -> wire.Piece | None:
        """The next rectangle of ready, unsent blocks x layers (None: nothing ready)."""
        if self.first is None:
            return None
        ready = [(self.sent[l], l) for l in range(self.L) if self.sent[l] < self.done[l]]
        if not ready:
            return None
        lo = min(ready)[1]      # the oldest unsent blocks first, then the lowest layer
        b0, b1 = self.sent[lo], self.done[lo]
        lb = wire.layer_bytes(self.engine.kv)
        b1 = min(b1, b0 + max(1, self.max_bytes // lb))
        hi = lo + 1
        max_layers = max(1, self.max_bytes // (lb * (b1 - b0)))
        while (hi < self.L and hi - lo < max_layers and self.sent[hi] == b0
               and self.done[hi] >= b1):
            hi += 1
        for l in range(lo, hi):
            self.sent[l] = b1
        return self._piece(b0, b1, lo, hi)

    def _piece(self, b0: int, b1: int, l0: int, l1: int) -> wire.Piece:
        """Engine block indices -> destination indices (the job's block list)."""
        p = wire.Piece(self.index, b0 - self.skip, b1 - self.skip, l0, l1)
        self.index += 1
        return p

    def rest(self) -> list[wire.Piece]:
        """After the compute: the blocks decode wants that were never computed here, and
        anything left unsent, as whole-block writes."""
        lo = self.skip
        hi = self.end if self.first is None else max(self.skip, min(self.first, self.end))
        pieces = [self._piece(self.skip + p.b0, self.skip + p.b1, p.l0, p.l1)
                  for p in wire.plan(hi - lo, self.engine.kv, self.max_bytes)]
        if self.first is None:
            self.sent = [self.end] * self.L
        elif min(self.done) < self.end:
            log.warning("%s: layers short after the compute: first=%s skip=%d end=%d "
                        "prompt=%d done=%s sent=%s", self.job.request_id, self.first, self.skip,
                        self.end, self.prompt_len, self.done, self.sent)
        # the compute is over, so every block is final at every layer: what the listener
        # did not report (next_piece) still goes, and the stream always drains
        self.done = [self.end] * self.L
        return pieces

    async def pump(self) -> None:
        tasks: set[asyncio.Task] = set()
        rest: list[wire.Piece] | None = None
        ledger, window = self.sender.ledger, self.sender.window
        while True:
            # forget finished writes first: a full window of writes that have all completed
            # must free the window now (the wake their callbacks gave is being spent)
            tasks = {t for t in tasks if not t.done()}
            while len(tasks) < window and ledger.may_issue(self.attempt) and not self.errors:
                if rest is None and self.finished:
                    rest = self.rest()
                p = self.next_piece() or (rest.pop(0) if rest else None)
                if p is None:
                    break
                t = asyncio.ensure_future(self._write(p, during=not self.finished))
                t.add_done_callback(lambda _: self.wake.set())
                tasks.add(t)
            stopped = not ledger.may_issue(self.attempt) or bool(self.errors)
            drained = rest is not None and not rest and all(
                s >= self.end for s in self.sent)
            if not tasks and (stopped or drained):
                return
            self.wake.clear()
            if any(t.done() for t in tasks):
                continue
            await self.wake.wait()

    async def _write(self, p: wire.Piece, during: bool) -> None:
        """during: issued while the prompt was still computing (a streamed write, however
        long the link then takes to carry it)."""
        src = self.engine.port.kept_blocks(self.local_id)[self.skip:self.end]
        n = await self.sender.write(self.job, self.engine, self.attempt, src, p, self.errors)
        self.bytes += n
        if n and during:
            self.sender.counters["kv_writes_streamed"] += 1
            self.sender.counters["kv_bytes_streamed"] += n

    async def finish(self) -> tuple[list[str], int]:
        """The compute is over: write what is left; (errors, bytes) once nothing of the
        attempt is in flight."""
        self.finished = True
        self.wake.set()
        await asyncio.shield(self.task)
        return self.errors, self.bytes
