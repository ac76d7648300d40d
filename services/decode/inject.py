"""TEST ONLY: decode's faults (faults.py) applied as wrappers around the service's parts,
so the request path has no fault branches:

    FaultySlots      selected PD requests get their received prompt KV corrupted just
                     before they start decoding (zero_layer / swap / noise)
    repeat_loop      on_submit is wrapped: selected requests get a +100 logit bias
    FaultyPeers      prefill jobs leave without their constraint; token chunks are lost
    guard switches   the request table grants every claim and frees at once
                     (no_reclaim_ack); the slots let every write land (no_epoch_fence)
"""
from __future__ import annotations

import logging

import msgspec

from . import faults
from .faults import DecodeFaults

log = logging.getLogger("pdmesh.decode")


def install(svc, f: DecodeFaults) -> dict[str, int]:
    """Wrap svc's parts for every fault set in f; returns the injection counters."""
    injected = dict.fromkeys(f.kinds(), 0)
    if f.no_reclaim_ack:
        svc.table.ack_enabled = False
    if f.no_epoch_fence:
        svc.slots.epoch_fence = False
    if set(f.kinds()) & set(faults.KV_KINDS):
        svc.slots = FaultySlots(svc.slots, f, injected)
    if f.repeat_loop:
        svc.on_submit = _repeat_loop(svc, f, injected)
    return injected


def wrap_peers(peers, f: DecodeFaults):
    if f.drop_constraint_in_job or f.drop_chunk_seq >= 0 or f.drop_last_chunk:
        return FaultyPeers(peers, f)
    return peers


class FaultySlots:
    def __init__(self, inner, f: DecodeFaults, injected: dict[str, int]):
        self.inner = inner
        self.f = f
        self.injected = injected
        self.selected: dict[str, tuple[str, int, list[int]]] = {}   # rid -> kind, seed, dest

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reserve(self, rid, prompt_ids, params, *args, **kw):
        slots = self.inner.reserve(rid, prompt_ids, params, *args, **kw)
        kind = self.f.select(params.seed)
        if kind in faults.KV_KINDS:
            self.selected[rid] = (kind, params.seed, list(slots.dest))
        return slots

    def start(self, rid, *args, **kw):
        if rid in self.selected:
            self._corrupt(rid, *self.selected.pop(rid))
        return self.inner.start(rid, *args, **kw)

    def fallback(self, rid, *args, **kw):
        self.selected.pop(rid, None)
        return self.inner.fallback(rid, *args, **kw)

    def drop(self, rid, *args, **kw):
        self.selected.pop(rid, None)
        return self.inner.drop(rid, *args, **kw)

    def _corrupt(self, rid: str, kind: str, seed: int, blocks: list[int]) -> None:
        self.inner.engine.port.tamper(
            rid, blocks, lambda kv, ids, others: faults.corrupt(kind, kv, ids, seed, others,
                                                                self.f.noise_scale))
        self.injected[kind] += 1
        log.warning("%s: TEST ONLY fault %s injected into %d KV blocks", rid, kind, len(blocks))


def _repeat_loop(svc, f: DecodeFaults, injected: dict[str, int]):
    handler = svc.on_submit
    tok = svc.engine.tokenizer
    token = tok.encode(" the")[-1] if tok is not None else 1

    async def on_submit(sub):
        if f.select(sub.params.seed) == faults.REPEAT_LOOP:
            sub = msgspec.structs.replace(sub, params=faults.repeat_loop(sub.params, token))
            injected[faults.REPEAT_LOOP] += 1
        return await handler(sub)

    return on_submit


class FaultyPeers:
    def __init__(self, inner, f: DecodeFaults):
        self.inner = inner
        self.f = f
        self.dropped = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def queue_job(self, job) -> None:
        if self.f.drop_constraint_in_job:
            job = faults.drop_constraint(job)
        await self.inner.queue_job(job)

    async def send_chunk(self, subject: str, chunk) -> None:
        if chunk.seq == self.f.drop_chunk_seq or (self.f.drop_last_chunk and chunk.finished):
            self.dropped += 1
            log.warning("%s: TEST ONLY token chunk %d dropped", chunk.request_id, chunk.seq)
            return
        await self.inner.send_chunk(subject, chunk)
