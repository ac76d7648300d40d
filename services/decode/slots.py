"""Decode's side of the PD slot protocol, over the engine's held sequences.

    reserve  a held sequence with blocks for the prompt; the leading blocks decode already
             has (its L1, or a kvstore load it runs itself) are skipped, the rest are the
             writer's destination, each stamped with its current epoch
    write    a KV write lands only if every block it names is still in the epoch the
             write was issued under (the epoch fence, invariant 3's second guard)
    start    every write is in: new epochs for the blocks (no write may land from now on),
             and the sequence joins the batch with prefill's first token
    fallback the remote prefill is given up: the reserved blocks leave the sequence
             (freed or quarantined by the caller) and it computes its own prompt
    drop     abort: the reserved blocks leave the sequence (freed or quarantined)

Who may still write which blocks, and when quarantined blocks go back, is the request
table's business (lifecycle.py); this module only touches the engine, through its KvPort
(shared/engine/kv_port.py).
Test-only guard switch: epoch_fence=False lets every write land where it points, like a
one-sided RDMA write with no fence.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.contracts.kv import KvWrite
from shared.engine.block_pool import NoFreeBlocks
from shared.engine.engine import LLMEngine
from shared.engine.layer_load import LayerLoad
from shared.engine.output import RequestOutput


@dataclass(frozen=True, slots=True)
class Slots:
    """What decode reserved for one request's remote prefill."""
    dest: list[int]            # the writer fills these (prompt blocks skip.. end)
    epochs: list[int]
    held: list[int]            # every engine block the request holds meanwhile
    skip: int                  # leading prompt blocks served here (L1 or the load)
    load: LayerLoad | None     # the caller fills it from kvstore
    kvstore_blocks: int | None = None   # what kvstore held when looked up (None: not asked)


class KvSlots:
    def __init__(self, engine: LLMEngine, epoch_fence: bool = True, max_held: int = 0):
        self.engine = engine
        self.epoch_fence = epoch_fence
        self.max_held = max_held or engine.cfg.max_num_seqs * 4

    def reserve(self, rid: str, prompt_ids: list[int], params, constraint=None,
                tier_blocks: int = 0, held_now: int = 0, replay: int = 0,
                cache_salt: str = "") -> Slots:
        """Raises NoFreeBlocks when short (or too many requests await KV)."""
        eng = self.engine
        if eng.port.busy()[0] + held_now >= self.max_held:
            raise NoFreeBlocks("too many requests awaiting KV")
        reserve = len(prompt_ids) + (params.max_tokens if eng.cfg.deterministic else 0)
        return Slots(*eng.port.reserve(rid, prompt_ids, params, constraint, tier_blocks, reserve,
                                       replay, cache_salt))

    def write(self, w: KvWrite, payload) -> bool:
        """Apply one KV write if the fence lets it land; whether it landed. ValueError
        when the payload does not fit the pool."""
        return self.engine.port.write(w, payload, self.epoch_fence)

    def fence_holds(self, w: KvWrite) -> bool:
        """Would the fence let this write land now? Asked on the event loop before the
        write's bytes are read: write() asks again (a start or a reclaim may come
        between)."""
        return self.engine.port.fence_holds(w.block_ids, w.epochs, self.epoch_fence)

    def start(self, rid: str, first_token: int, logprob=None, top_logprobs=None) -> RequestOutput:
        """Raises ReplayError (request dropped) if the first token breaks decode's grammar:
        prefill and decode disagree about the constraint, and guessing would be wrong."""
        return self.engine.port.start(rid, first_token, logprob, top_logprobs)

    def fallback(self, rid: str, keep_blocks: bool) -> None:
        """Prefill here, in fresh blocks. keep_blocks: the reserved ones stay out of the
        pool (quarantined by the caller), else they are freed."""
        eng = self.engine
        blocks = eng.port.detach_blocks(rid)
        if not keep_blocks:
            eng.port.free_blocks(blocks)
        eng.port.requeue(rid)

    def drop(self, rid: str, keep_blocks: bool) -> None:
        """Abort a request that awaits KV. keep_blocks: as for fallback."""
        if keep_blocks:
            self.engine.port.detach_blocks(rid)
        self.engine.abort(rid)

    def release(self, blocks: list[int]) -> None:
        """A quarantine ended: its blocks go back to the pool."""
        self.engine.port.free_blocks(blocks)
