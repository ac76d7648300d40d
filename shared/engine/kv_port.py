"""KvPort: everything a PD service does to an engine's KV and blocks from outside its
step (in the spirit of vLLM's KVConnectorBase_V1, whose docstring lists every method).

Decode's slot protocol (services/decode/slots.py), the kvstore write-back
(shared/kvstore_client.py), the LayerSplit group's inserts and the test-only fault
injection reach the engine's block pool, scheduler and request table only through these
methods, called on the engine's owner thread (engine.py: the service's event loop) like
every other engine method: none of them can interleave with a step's bookkeeping, and a
write lands only in a held sequence's blocks, which no running forward reads. No module
outside shared/engine/ touches those tables (tests/test_code_shape.py checks), so every
rule about when a block may be read or written while a step runs is here or in engine.py.

  num_blocks             the pool's size
  busy()                 (running sequences, waiting sequences)
  hold(...)              a sequence with its prompt's blocks, not scheduled (KV from outside)
  resume(rid, token)     a held sequence joins the batch with its first token
  detach_blocks(rid)     a held sequence gives its blocks to the caller (free_blocks later)
  requeue(rid)           a held sequence (blocks detached) computes its own prompt
  free_blocks(blocks)    detached blocks back to the pool
  kept_blocks(rid)       a finished prefill-only request's blocks (until engine.release)
  computed_prompt_blocks(rid)  a request's computed whole prompt blocks and prefix keys
  reserve(...)           hold a sequence; its destination blocks, their epochs, all its blocks
  fence_holds(ids, eps)  the epoch fence's question (asked on the header, again at write)
  write(w, payload, f)   apply one KvWrite if the fence lets it land
  start(rid, token, ..)  every write is in: new epochs for its blocks, join the batch
  snapshot(blocks, copy) a host copy of these blocks' KV (layer-major unless copy says)
  tamper(rid, blocks, f) TEST ONLY: f(kv, blocks, others), others being the computed
                         blocks of every other running sequence
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sampling import SampleOutput
from .scheduler import cancel_load
from .sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from shared.contracts.kv import KvWrite

    from .engine import LLMEngine
    from .layer_load import LayerLoad
    from .output import RequestOutput


class KvPort:
    def __init__(self, engine: LLMEngine):
        self._e = engine

    @property
    def num_blocks(self) -> int:
        return self._e.pool.num_blocks

    def busy(self) -> tuple[int, int]:
        e = self._e
        return len(e.scheduler.running), len(e.scheduler.waiting)

    # ---- held sequences (KV filled from outside) ----------------------------------
    def hold(self, request_id: str, prompt_ids: list[int], params, constraint=None,
             tier_blocks: int = 0, reserve_tokens: int = 0, replay: int = 0, cache_salt: str = ""
             ) -> tuple[Sequence, LayerLoad | None]:
        """A sequence with blocks for max(reserve_tokens, prompt) tokens, not scheduled:
        its leading seq.num_cached prompt tokens come from the prefix cache (L1, or the
        returned load from a lower tier), the caller fills the rest. Raises NoFreeBlocks
        when short (nothing is kept)."""
        e = self._e
        seq = e._new_seq(request_id, prompt_ids, params, constraint, replay)
        seq.cache_salt = cache_salt
        load = e.prefix.attach(seq, tier_blocks)
        need = e.pool.blocks_for(max(reserve_tokens, len(prompt_ids))) - len(seq.block_table)
        try:
            seq.block_table += e.pool.allocate(need)
        except Exception:
            del e.requests[request_id]
            cancel_load(seq)
            e.pool.free(seq.block_table)
            raise
        seq.status = SeqStatus.HELD
        return seq, load

    def resume(self, request_id: str, first_token: int, logprob=None,
               top_logprobs=None) -> RequestOutput:
        """A held sequence's prompt KV is all in: join the batch with its first token.
        Raises ReplayError (request dropped) if the token breaks the request's grammar."""
        e = self._e
        req = e.requests[request_id]
        seq = req.seq
        if seq.status is not SeqStatus.HELD:
            raise ValueError(f"request {request_id!r} is not held")
        if req.constraint is not None and not req.constraint.accept(first_token):
            from .grammar import ReplayError
            e._finish_abort(request_id)
            raise ReplayError(0, first_token)
        seq.num_computed = len(seq.prompt_ids)
        e.prefix.register(seq)
        e.scheduler.add_running(seq)
        return e.append_token(seq, first_token, SampleOutput(first_token, logprob, top_logprobs))

    def detach_blocks(self, request_id: str) -> list[int]:
        """A held sequence gives its blocks to the caller, who frees them (free_blocks)
        once nobody can write them any more; the sequence keeps none."""
        seq = self._held(request_id)
        cancel_load(seq)
        blocks, seq.block_table = seq.block_table, []
        return blocks

    def requeue(self, request_id: str) -> None:
        """A held sequence (blocks detached) computes its own prompt, in fresh blocks."""
        seq = self._held(request_id)
        if seq.block_table:
            raise ValueError(f"request {request_id!r} is not held without blocks")
        self._e.prefix.attach(seq)
        self._e.scheduler.add(seq)

    def _held(self, request_id: str) -> Sequence:
        seq = self._e.requests[request_id].seq
        if seq.status is not SeqStatus.HELD:
            raise ValueError(f"request {request_id!r} is not held")
        return seq

    def free_blocks(self, blocks: list[int]) -> None:
        self._e.pool.free(blocks)

    def kept_blocks(self, request_id: str) -> list[int]:
        """Blocks of a finished prefill-only request (valid until engine.release())."""
        return list(self._e.requests[request_id].seq.block_table)

    def computed_prompt_blocks(self, request_id: str) -> tuple[list[int], list[bytes]]:
        """A live request's whole prompt blocks whose KV is computed, and their prefix
        keys (for a write-back to a lower tier); empty while the prompt is not done."""
        req = self._e.requests.get(request_id)
        if req is None or req.seq.num_computed < len(req.seq.prompt_ids):
            return [], []
        seq, keys = req.seq, req.seq.keys
        k = min(seq.num_evicted, len(keys))      # evicted ones hold nobody's KV any more
        return list(seq.block_table[k:len(keys)]), list(keys[k:])

    # ---- PD writes ------------------------------------------------------------------
    def reserve(self, rid: str, prompt_ids: list[int], params, constraint=None,
                tier_blocks: int = 0, reserve_tokens: int = 0, replay: int = 0,
                cache_salt: str = ""
                ) -> tuple[list[int], list[int], list[int], int, LayerLoad | None]:
        """hold(), then (dest, epochs, held, skip, load): the prompt blocks after
        the `skip` leading ones the prefix cache (or the returned load) serves, each
        stamped with its current epoch, and every block the sequence holds. Raises
        NoFreeBlocks when short."""
        e = self._e
        seq, load = self.hold(rid, prompt_ids, params, constraint, tier_blocks,
                              reserve_tokens, replay, cache_salt)
        skip = seq.num_cached // e.cfg.block_size
        dest = seq.block_table[skip:e.pool.blocks_for(len(prompt_ids))]
        return dest, [e.pool.epoch[b] for b in dest], list(seq.block_table), skip, load

    def fence_holds(self, block_ids: list[int], epochs: list[int], fence: bool = True) -> bool:
        """Every block id is in the pool and (fence) still in the epoch the write was
        issued under. Asked on a write's header before its bytes are read, and again by
        write() (the bytes may arrive after a start or a reclaim)."""
        pool = self._e.pool
        if len(block_ids) != len(epochs) or not all(0 <= b < pool.num_blocks for b in block_ids):
            return False
        return not fence or all(pool.epoch[b] == e for b, e in zip(block_ids, epochs))

    def write(self, w: KvWrite, payload, fence: bool = True) -> bool:
        """Apply one KV write if the fence lets it land; whether it landed. ValueError
        when the payload does not fit the pool."""
        from shared.kv.wire import unpack_into

        e = self._e
        landed = self.fence_holds(w.block_ids, w.epochs, fence)
        if landed:
            unpack_into(e.kv, w.block_ids, w.layer_start, w.layer_end, payload, w.dtype,
                        w.shape)
        return landed

    def start(self, rid: str, first_token: int, logprob=None, top_logprobs=None
              ) -> RequestOutput:
        """A held sequence's KV is all in: its blocks get new epochs (no write issued
        before lands from now on) and it joins the batch with its first token. Raises
        ReplayError (request dropped) if the token breaks its grammar."""
        self._e.pool.restamp(self._held(rid).block_table)     # held: nothing evicted
        return self.resume(rid, first_token, logprob, top_logprobs)

    def snapshot(self, blocks: list[int], copy=None) -> torch.Tensor:
        """A host copy of these blocks' KV (the caller holds them): copy(kv, blocks), by
        default layer-major [L, 2, n, BS, Hkv, D]."""
        e = self._e
        if copy is not None:
            return copy(e.kv, blocks)
        return e.kv[:, :, torch.tensor(blocks, dtype=torch.long)].to("cpu", copy=True)

    def tamper(self, rid: str, blocks: list[int] | None, fn) -> None:
        """TEST ONLY (fault injection): fn(kv, blocks, others). blocks:
        None means rid's prompt blocks; others: the computed blocks of every other
        running sequence (a fault must not touch them)."""
        e = self._e
        if blocks is None:
            seq = e.requests[rid].seq
            blocks = seq.block_table[:e.pool.blocks_for(len(seq.prompt_ids))]
        others = [b for s in e.scheduler.running if s.request_id != rid
                  for b in s.block_table[:e.pool.blocks_for(s.num_computed)]]
        fn(e.kv, blocks, others)
