"""LLMEngine: the model runner used by prefill and decode.

Life cycle of a request:
  add_request -> WAITING -> (scheduler admits, allocates blocks) RUNNING
  -> each step computes a prefill chunk or one decode token; reaching the last token
     samples the next one -> output processor (detokenize, stop checks)
  -> FINISHED (blocks freed; a prefill-only request keeps them until release()).

Phases of a step: schedule -> prepare (flat batch + attention metadata) -> run_model ->
sample -> postprocess.

Remote prefill (decode side): reserve_remote allocates blocks for a prompt whose KV
another process computes; writes land through accept_kv (epoch-fenced); start_remote
joins the sequence to the batch with its first token. An aborted (or locally re-prefilled)
request whose blocks may still be written can leave them quarantined: out of the pool,
never handed out, until release_quarantined() once no write can land any more.

Prefix cache (L1): whole prompt blocks are indexed by a chained key of their tokens
(prefix.py); a request takes the longest cached prefix and computes only the rest. A
longer prefix found in a lower tier (kvstore) is loaded layer by layer into fresh blocks
while the rest computes; compute on layer i waits until layer i has landed
(layer_load.py). In deterministic mode only prefixes whose KV is bit-identical however
the prompt is split are shared: whole chunks (multiples of chunk_size).

Speculative decoding (cfg.draft_model): decode steps carry k draft tokens that one target
forward verifies; the draft's KV shares the pool's block ids (spec/runner.py).

Threading: step() may run in a worker thread while the service's event loop adds,
aborts and applies KV writes. Bookkeeping happens under `lock`; the forward pass runs
without it. An abort that arrives during a forward is applied right after it, so a
freed block can never be written by a forward that is still running.
"""
from __future__ import annotations

import itertools
import random
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .block_pool import BlockPool, NoFreeBlocks
from .config import EngineConfig
from .layer_load import LayerLoad, LoadFailed
from .loader import load_config, load_weights
from .model import BatchMeta, Model, SeqSpan, kv_block_bytes, kv_pool
from .output import OutputProcessor, RequestOutput
from .prefix import prefix_salt
from .prefix_cache import PrefixCacheMixin
from .sampling import SampleInput, fit_banned, sample
from .scheduler import Scheduled, Scheduler, cancel_load
from .sequence import Sequence


class Reservation(NamedTuple):
    blocks: list[int]          # the remote writer fills these (prompt blocks skip.. end)
    epochs: list[int]
    skip: int                  # leading prompt blocks served here (L1 or the load)
    load: LayerLoad | None     # the caller fills it from the lower tier


@dataclass(slots=True)
class _Req:
    seq: Sequence
    proc: OutputProcessor
    constraint: object = None     # grammar.ConstraintState, or None when unconstrained


class LLMEngine(PrefixCacheMixin):
    def __init__(self, cfg: EngineConfig, tokenizer="auto"):
        """tokenizer: "auto" loads the folder's tokenizer; None serves token ids only
        (no text, no stop strings); or pass a shared Tokenizer."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.model_cfg = load_config(cfg.model)
        if tokenizer == "auto":
            from .tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(cfg.model)
        self.tokenizer = tokenizer
        weights = load_weights(cfg.model, self.model_cfg, cfg.torch_dtype)
        self.model = Model(self.model_cfg, weights, cfg.torch_dtype)
        mc = self.model_cfg
        dc = load_config(cfg.draft_model) if cfg.speculative else None
        if dc is not None and dc.vocab_size != mc.vocab_size:
            raise ValueError(f"draft model {cfg.draft_model} has vocab_size {dc.vocab_size}; "
                             f"the target's is {mc.vocab_size}: they must share a tokenizer")
        models = [c for c in (mc, dc) if c is not None]
        self.max_model_len = min([cfg.max_model_len or mc.max_position]
                                 + [c.max_position for c in models])
        # a block id names target KV and (when speculating) the draft's, in two pools
        block_bytes = sum(kv_block_bytes(c, cfg.block_size, cfg.torch_dtype) for c in models)
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // block_bytes)
        self.kv = kv_pool(mc, num_blocks, cfg.block_size, cfg.torch_dtype)
        self.draft_kv = self.spec = None
        if dc is not None:
            from .spec.runner import SpecRunner
            self.draft_kv = kv_pool(dc, num_blocks, cfg.block_size, cfg.torch_dtype)
            draft = Model(dc, load_weights(cfg.draft_model, dc, cfg.torch_dtype), cfg.torch_dtype)
            self.spec = SpecRunner(self, draft)
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.pool)
        if self.spec is not None:
            self.scheduler.lookahead = self.spec.lookahead
        self.requests: dict[str, _Req] = {}
        self.remote: dict[str, Sequence] = {}      # reserved, awaiting remote KV
        self.quarantined: dict[str, list[int]] = {}  # aborted remote requests' blocks
        self._arrival = itertools.count()
        self._rng = random.Random()
        self.lock = threading.RLock()
        self._inflight: set[str] = set()
        self._deferred_aborts: set[str] = set()
        self._grammar = None
        fp = self.tokenizer.fingerprint if self.tokenizer is not None else ""
        self.cache_salt = prefix_salt(str(mc), fp, cfg.dtype, str(cfg.block_size))
        self.counters = {"prefix_hit_tokens": 0, "prompt_tokens": 0, "loads": 0,
                         "load_failures": 0, "loaded_blocks": 0,
                         "spec_steps": 0, "spec_proposed": 0, "spec_accepted": 0}
        self.last_load: dict = {}       # timeline of the latest completed layer-wise load

    @property
    def grammar(self):
        """The grammar compiler for this vocabulary (built on first constrained request)."""
        if self._grammar is None:
            from .grammar import GrammarCompiler
            self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.model_cfg.vocab_size)
        return self._grammar

    # ---- requests -----------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params) -> None:
        """ValueError with the numbers when a request can never be served."""
        params.check(self.model_cfg.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_cfg.vocab_size}): {bad[:5]}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the context window of {self.max_model_len} tokens")
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise ValueError(
                f"request needs {self.pool.blocks_for(total)} KV blocks; the pool has "
                f"{self.pool.num_blocks}")

    def _new_seq(self, request_id, prompt_ids, params, constraint=None) -> Sequence:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_request(prompt_ids, params)
        state = None
        if constraint is not None and constraint.kind.value != "none":
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer")
            state = self.grammar.new_state(constraint)   # ConstraintError is a ValueError
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_ids), params, seed, next(self._arrival))
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        detok = None
        if self.tokenizer is not None:
            from .tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        proc = OutputProcessor(params, eos, detok, self.max_model_len, len(prompt_ids))
        self.requests[request_id] = _Req(seq, proc, state)
        return seq

    def add_request(self, request_id: str, prompt_ids: list[int], params,
                    prefill_only: bool = False, constraint=None,
                    tier_blocks: int = 0) -> LayerLoad | None:
        """tier_blocks: how many leading blocks of prefix_keys(prompt) a lower tier holds.
        Returns the LayerLoad the caller must fill (blocks beyond the L1 hit), or None."""
        with self.lock:
            seq = self._new_seq(request_id, prompt_ids, params, constraint)
            seq.stop_after_prefill = prefill_only
            load = self._attach_prefix(seq, tier_blocks)
            self.scheduler.add(seq)
            return load

    def abort(self, request_id: str, quarantine: bool = False) -> bool:
        """Stop a request and free its blocks (after the current forward if it is in
        one). quarantine: a request still awaiting remote KV keeps its blocks out of the
        pool until release_quarantined(). Returns whether the request was known."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            if request_id in self._inflight:
                self._deferred_aborts.add(request_id)
                return True
            self._finish_abort(req.seq, quarantine)
            return True

    def _finish_abort(self, seq: Sequence, quarantine: bool = False) -> None:
        self.requests.pop(seq.request_id, None)
        cancel_load(seq)
        if self.remote.pop(seq.request_id, None) is not None:
            self._drop_blocks(seq, quarantine)
            return
        self.scheduler.finish(seq, "abort")

    def _drop_blocks(self, seq: Sequence, quarantine: bool) -> None:
        if quarantine:
            self.quarantined[seq.request_id] = seq.block_table
        else:
            self.pool.free(seq.block_table)
        seq.block_table = []

    def release_quarantined(self, request_id: str) -> int:
        """Return a quarantined request's blocks to the pool; how many there were."""
        with self.lock:
            blocks = self.quarantined.pop(request_id, [])
            self.pool.free(blocks)
            return len(blocks)

    @property
    def num_quarantined(self) -> int:
        return sum(len(b) for b in self.quarantined.values())

    # ---- remote prefill (decode side) ------------------------------------------------
    def reserve_remote(self, request_id: str, prompt_ids: list[int], params,
                       constraint=None, tier_blocks: int = 0) -> Reservation:
        """Allocate blocks for a prompt another process prefills. The prompt's prefix
        cached here (L1), or loaded here from a lower tier holding `tier_blocks` leading
        blocks (the returned load, which the caller fills), is not written by the
        prefill: `skip` leading prompt blocks are left out of the writer's blocks.
        Raises NoFreeBlocks when short."""
        with self.lock:
            if len(self.scheduler.running) + len(self.remote) >= self.cfg.max_num_seqs * 4:
                raise NoFreeBlocks("too many requests awaiting KV")
            n = len(prompt_ids) + (params.max_tokens if self.cfg.deterministic else 0)
            seq = self._new_seq(request_id, prompt_ids, params, constraint)
            load = self._attach_prefix(seq, tier_blocks)
            need = self.pool.blocks_for(max(n, len(prompt_ids))) - len(seq.block_table)
            try:
                seq.block_table += self.pool.allocate(need)
            except Exception:
                del self.requests[request_id]
                cancel_load(seq)
                self.pool.free(seq.block_table)
                raise
            self.remote[request_id] = seq
            skip = seq.num_cached // self.cfg.block_size
            dest = seq.block_table[skip:self.pool.blocks_for(len(prompt_ids))]
            return Reservation(dest, [self.pool.epoch[b] for b in dest], skip, load)

    def accept_kv(self, block_ids: list[int], epochs: list[int]) -> bool:
        """Whether a KV write may land: every block is still in the epoch the write was
        issued under (the epoch fence). Any reallocation or start_remote() changes a
        block's epoch, so a late write can never reach a block that has moved on; one
        that lands in its own still-reserved or quarantined blocks harms nobody.
        With cfg.epoch_fence off (TEST ONLY) every write lands where it points, like a
        one-sided RDMA write with no fence. Call under lock."""
        if len(block_ids) != len(epochs) or not all(
                0 <= b < self.pool.num_blocks for b in block_ids):
            return False
        if not self.cfg.epoch_fence:
            return True
        return all(self.pool.epoch[b] == e for b, e in zip(block_ids, epochs))

    def start_remote(self, request_id: str, first_token: int, logprob=None,
                     top_logprobs=None) -> RequestOutput:
        """All prompt KV has landed: join the batch with the first token prefill sampled.
        Raises ReplayError (request dropped) if the token breaks this side's grammar:
        prefill and decode disagree about the constraint, and guessing would be wrong."""
        from .sampling import SampleOutput

        with self.lock:
            state = self.requests[request_id].constraint
            if state is not None and not state.accept(first_token):
                from .grammar import ReplayError
                self._finish_abort(self.requests[request_id].seq)
                raise ReplayError(0, first_token)
            seq = self.remote.pop(request_id)
            self.pool.restamp(seq.block_table)   # no write may land from now on
            seq.num_computed = len(seq.prompt_ids)
            self._register(seq)
            self.scheduler.add_running(seq)
            return self.append_token(seq, first_token, SampleOutput(first_token, logprob, top_logprobs))

    def prefill_locally(self, request_id: str, quarantine: bool = False) -> None:
        """Give up on the remote prefill: compute the prompt here, in fresh blocks.
        quarantine: the reserved blocks stay out of the pool (see abort)."""
        with self.lock:
            seq = self.remote.pop(request_id)
            cancel_load(seq)
            self._drop_blocks(seq, quarantine)
            self._attach_prefix(seq)
            self.scheduler.add(seq)

    def kept_blocks(self, request_id: str) -> list[int]:
        """Blocks of a finished prefill-only request (valid until release())."""
        return list(self.requests[request_id].seq.block_table)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept."""
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is not None and req.seq.block_table:
                self.pool.free(req.seq.block_table)
                req.seq.block_table = []

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            self._inflight = {s.seq.request_id for s in batch}
        if self.spec is not None:
            self.spec.propose(batch)      # draft forwards: fill s.drafts (without the lock)
        with self.lock:
            input_ids, meta, sampled = self.prepare(batch)
        try:
            logits = self.model.forward(input_ids, meta, self.kv)
        except LoadFailed:
            logits = None
        with self.lock:
            self._inflight = set()
            outs = [] if logits is None else self.postprocess(batch, sampled, logits)
            if logits is None:
                self._recompute_failed_loads(batch)
            for rid in self._deferred_aborts:
                req = self.requests.get(rid)
                if req is not None:
                    self._finish_abort(req.seq)
            aborted, self._deferred_aborts = self._deferred_aborts, set()
            return [o for o in outs if o.request_id not in aborted]

    def prepare(self, batch: list[Scheduled]):
        """Flat batch: decode rows first (batched paged attention), then chunks.
        A speculative step's rows are its last token then its drafts, each attending like
        a decode row over its own position; all of them are sampled."""
        bs = self.cfg.block_size
        det = self.cfg.deterministic
        # a lone decode row attends through SDPA on its exact context (cheaper than the
        # padded batched path at batch size 1)
        decode = [] if det else [s for s in batch if s.rows == 1 or s.drafts]
        if sum(s.rows for s in decode) == 1:
            decode = []
        chunks = [s for s in batch if s not in decode]
        ids, pos, slots, spans, rows, sampled = [], [], [], [], [], []
        row = 0
        for s, is_chunk in [(s, False) for s in decode] + [(s, True) for s in chunks]:
            seq = s.seq
            p = list(range(s.start, s.start + s.rows))
            ids += [seq.token_at(i) for i in p[:s.n]] + s.drafts
            pos += p
            slots += [seq.block_table[i // bs] * bs + i % bs for i in p]
            if is_chunk:
                ctx = s.start + s.rows
                bt = torch.tensor(seq.block_table, dtype=torch.long)
                ctx_slots = (bt.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx]
                if det and s.drafts:   # each row exactly as its own decode step computes it
                    spans += [SeqSpan(row + j, 1, i + 1, ctx_slots[:i + 1])
                              for j, i in enumerate(p)]
                else:
                    spans.append(SeqSpan(row, s.rows, ctx, ctx_slots))
            row += s.rows
            if s.samples:
                rows += range(row - 1 - len(s.drafts), row)
                sampled.append(s)
        meta = BatchMeta(positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
                         spans=spans, logits_rows=torch.tensor(rows, dtype=torch.long))
        if self.cfg.load_guard:   # compute on layer i waits for layer i of these loads
            meta.loads = [s.seq.load for s in batch if s.seq.load is not None]
            meta.load_timeout_s = self.cfg.load_timeout_s
        if decode:
            nb = max(len(s.seq.block_table) for s in decode)
            meta.num_decode = sum(s.rows for s in decode)
            meta.block_tables = torch.tensor(
                [s.seq.block_table + [0] * (nb - len(s.seq.block_table))
                 for s in decode for _ in range(s.rows)], dtype=torch.int32)
            meta.context_lens = torch.tensor([i + 1 for s in decode
                                              for i in range(s.start, s.start + s.rows)],
                                             dtype=torch.int32)
        if det:  # fixed shapes: pad rows and the LM head's M
            pad = self.cfg.max_num_batched_tokens - row
            ids += [0] * pad
            meta.positions = torch.cat([meta.positions, torch.zeros(pad, dtype=torch.long)])
            meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1)])
            meta.pad_logits_to = self.cfg.max_num_batched_tokens
        return torch.tensor(ids, dtype=torch.long), meta, sampled

    def postprocess(self, batch, sampled, logits) -> list[RequestOutput]:
        for s in batch:
            s.seq.num_computed = s.start + s.n
            if s.seq.keys:
                self._register(s.seq)
        outs, r = [], 0
        V = logits.shape[-1]
        for s in sampled:
            seq, req = s.seq, self.requests[s.seq.request_id]
            if s.drafts:              # rows r .. r+k: verify the drafts
                outs.append(self.spec.verify(s, logits[r:r + s.rows]))
                r += s.rows
                continue
            allowed = req.constraint.mask(V) if req.constraint is not None else None
            si = SampleInput(seq.params, seq.seed, seq.num_tokens, seq.prompt_ids, seq.output_ids,
                             banned=fit_banned(req.proc.banned(len(seq.output_ids)), allowed),
                             allowed_mask=allowed)
            res = sample(logits[r:r + 1], [si])[0]
            r += 1
            if req.constraint is not None:
                req.constraint.accept(res.token)   # sampled under its mask: always accepted
            outs.append(self.append_token(seq, res.token, res))
        return outs

    def append_token(self, seq: Sequence, token: int, res=None) -> RequestOutput:
        """Record a sampled token and run stop checks (also used for a remote first token)."""
        proc = self.requests[seq.request_id].proc
        seq.output_ids.append(token)
        text, reason, stop_reason = proc.process(token, len(seq.output_ids))
        state = self.requests[seq.request_id].constraint
        if reason is None and state is not None and state.is_terminated:
            reason = "stop"               # the grammar is complete and took its end token
        if reason is None and seq.stop_after_prefill:
            reason = "prefill_done"
        out = RequestOutput(seq.request_id, [token], text, reason is not None, reason, stop_reason,
                            num_prompt_tokens=len(seq.prompt_ids),
                            num_output_tokens=len(seq.output_ids),
                            num_cached_tokens=seq.num_cached, spec_steps=seq.spec_steps,
                            spec_proposed=seq.spec_proposed, spec_accepted=seq.spec_accepted)
        if res is not None and res.logprob is not None:
            out.logprobs.append((token, res.logprob, res.top_logprobs))
        if reason is not None:
            keep = seq.stop_after_prefill
            self.scheduler.finish(seq, reason, keep_blocks=keep)
            if not keep:
                del self.requests[seq.request_id]
        return out

    # ---- convenience --------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params) -> list[dict]:
        """Run prompts to completion (tests, benchmarks); returns token ids and text."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._arrival)}" for _ in prompts]
        results = {i: {"token_ids": [], "text": "", "finish_reason": None} for i in ids}
        for rid, p, sp in zip(ids, prompts, params_list):
            self.add_request(rid, p, sp)
        while self.has_unfinished:
            for o in self.step():
                r = results[o.request_id]
                r["token_ids"] += o.new_token_ids
                r["text"] += o.text
                if o.finished:
                    r["finish_reason"] = o.finish_reason
        return [results[i] for i in ids]

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_free": self.pool.num_free, "blocks_used": self.pool.num_used,
                "blocks_quarantined": self.num_quarantined, "blocks_total": self.pool.num_blocks,
                **self.pool.stats(), **self.counters}
