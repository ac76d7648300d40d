"""LLMEngine: the model runner used by prefill and decode.

Life cycle of a request:
  add_request -> WAITING -> (scheduler admits, allocates blocks) RUNNING
  -> each step computes a prefill chunk or one decode token; reaching the last token
     samples the next one -> output processor (detokenize, stop checks)
  -> FINISHED (blocks freed; a prefill-only request keeps them until release()).

Phases of a step: schedule -> flat batch (batch.py) -> model -> sample -> postprocess.

Held sequences (a prompt's blocks allocated without scheduling it, its KV filled from
outside) and every other PD hook live in `port` (kv_port.py, KvPort): hold, resume,
requeue, detach/free blocks, kept and computed prompt blocks, the epoch fence and writes.

Prefix cache (L1) and lower-tier loads: prefix_cache.py. Speculative decoding: decode steps
carry k draft tokens that one target forward verifies (spec/runner.py).

Ownership (vLLM v1's EngineCore in one process): one thread owns the engine, the service's
event loop (or the caller of step()). Every method below runs on it, so state never
changes under a reader and the engine takes no lock. Only the forward pass of a step runs
elsewhere (shared/engine_loop.py hands it to a worker thread):

    plan = begin_step()          owner: schedule, mark the batch in flight
    logits = forward(plan)       worker: draft proposals, the flat batch, the model
    outs = end_step(plan, logits)  owner: sample, stop checks, then the commands that waited

While a forward runs, the owner goes on serving: new requests, held sequences, KV writes
into held blocks (never in a batch) all apply at once. A command for a sequence in the
running batch (abort, release) would free blocks the forward still writes: it waits in
one queue that end_step drains, in order, and that request's outputs of the step are
dropped. The one other thread that writes KV is a lower tier's loader, fenced by its
LayerLoad (layer_load.py). `port` (kv_port.py) is what PD services do to the KV.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.cpu_ops.gemv import set_batch_helper
from shared.contracts.messages import FinishReason

from .batch import build_batch
from .block_pool import BlockPool
from .config import EngineConfig
from .kv_port import KvPort
from .layer_load import LayerLoad, LoadFailed
from .limits import check_request
from .loader import check_stop_ids, draft_config, load_config
from .model import kv_block_bytes, kv_pool, load_model
from .model_path import auto_quantize, resolve
from .output import OutputProcessor, RequestOutput
from .prefix import prefix_salt
from .prefix_cache import PrefixCache
from .sampling import SampleInput, fit_banned, sample
from .scheduler import Scheduler
from .sequence import Sequence
from .smooth import applies as smoothing_applies, calibration_ids


@dataclass(slots=True)
class StepPlan:
    """One step between begin_step and end_step: its batch, and (forward) its rows."""
    batch: list
    t0: float
    sampled: list = field(default_factory=list)


@dataclass(slots=True)
class _Req:
    seq: Sequence
    proc: OutputProcessor
    constraint: object = None     # grammar.ConstraintState, or None when unconstrained


class LLMEngine:
    def __init__(self, cfg: EngineConfig, tokenizer="auto"):
        """tokenizer: "auto" loads the folder's tokenizer; None serves token ids only
        (no text, no stop strings); or pass a shared Tokenizer."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        folder = resolve(cfg.model)          # a folder, or a Hub id in the local cache
        if cfg.quantize == "auto":
            cfg = cfg.with_quantize(auto_quantize(folder))
        self.cfg = cfg
        if cfg.batch_helper and cfg.quantize and cfg.device == "cpu":
            set_batch_helper(True)
        self.model_cfg = mc = load_config(folder)
        if tokenizer == "auto":
            from .tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(folder)
        self.tokenizer = tokenizer
        check_stop_ids(folder, tokenizer, mc.vocab_size)
        self.model = load_model(folder, mc, cfg, smooth_ids=calibration_ids(cfg, tokenizer))
        dc = draft_config(cfg, mc)
        models = [c for c in (mc, dc) if c is not None]
        self.max_model_len = min([cfg.max_model_len or mc.max_context]
                                 + [c.max_context for c in models])
        # a block id names target KV and (when speculating) the draft's, in two pools
        block_bytes = sum(kv_block_bytes(c, cfg.block_size, cfg.torch_dtype) for c in models)
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // block_bytes)
        self.kv = kv_pool(mc, num_blocks, cfg.block_size, cfg.torch_dtype, cfg.device)
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.pool)
        if dc is None and mc.layer_windows and all(mc.layer_windows):
            self.scheduler.window = max(mc.layer_windows)   # KV past every window is freed
        self.draft_kv = self.spec = None
        if dc is not None:
            self._start_speculation(dc, num_blocks)
        elif cfg.speculative:           # spec_method ngram: drafts without a model
            from .spec.ngram_runner import NgramRunner
            self.spec = NgramRunner(self)
            self.scheduler.lookahead = self.spec.lookahead
        self.requests: dict[str, _Req] = {}
        self._arrival, self._rng = itertools.count(), random.Random()
        self._inflight: set[str] = set()        # requests of the forward now running
        self._after_step: list[tuple[str, Callable[[], None]]] = []   # waiting for it
        self._grammar = None
        self.counters = dict.fromkeys(("prefix_hit_tokens", "prompt_tokens", "loads",
                                       "load_failures", "loaded_blocks", "spec_steps",
                                       "spec_proposed", "spec_accepted", "tail_hit_tokens"), 0)
        fp = self.tokenizer.fingerprint if self.tokenizer is not None else ""
        self.cache_salt = prefix_salt(str(mc), fp, cfg.dtype + cfg.quantize + "a8" * cfg.act_int8
                                      + "sq" * smoothing_applies(cfg),
                                      str(cfg.block_size))
        self.prefix = PrefixCache(cfg, self.pool, self.kv, mc.num_layers, self.cache_salt,
                                  self.counters)
        self.scheduler.attach_tail = self.prefix.attach_tail
        self.port = KvPort(self)      # what PD services do to the KV from outside step()

    def _start_speculation(self, dc, num_blocks: int) -> None:
        from .spec.runner import SpecRunner

        cfg = self.cfg
        self.draft_kv = kv_pool(dc, num_blocks, cfg.block_size, cfg.torch_dtype, cfg.device)
        draft = load_model(resolve(cfg.draft_model), dc, cfg, cfg.draft_quant)
        self.spec = SpecRunner(self, draft)
        self.scheduler.lookahead = self.spec.lookahead

    @property
    def grammar(self):
        """The grammar compiler for this vocabulary (built on first constrained request)."""
        if self._grammar is None:
            from .grammar import GrammarCompiler
            self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.model_cfg.vocab_size)
        return self._grammar

    # ---- prefix cache (prefix_cache.py) ---------------------------------------------
    def prefix_keys(self, prompt_ids: list[int], cache_salt: str = "") -> list[bytes]:
        return self.prefix.keys(prompt_ids, cache_salt)

    def cached_prefix_tokens(self, prompt_ids: list[int], cache_salt: str = "") -> int:
        return self.prefix.cached_tokens(prompt_ids, cache_salt)

    def write_loaded_layer(self, load: LayerLoad, layer: int, data: torch.Tensor,
                           b0: int = 0) -> bool:
        return self.prefix.write_loaded_layer(load, layer, data, b0)

    @property
    def last_load(self) -> dict:
        return self.prefix.last_load

    # ---- requests -----------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params) -> None:
        """ValueError with the numbers when a request can never be served."""
        w = self.scheduler.window
        check_request(prompt_ids, params, self.model_cfg.vocab_size, self.max_model_len,
                      self.pool, w + self.cfg.max_num_batched_tokens
                      if w and not self.cfg.deterministic else 0)

    def _new_seq(self, request_id, prompt_ids, params, constraint=None, replay: int = 0
                 ) -> Sequence:
        """replay: the last `replay` prompt tokens are output already generated under the
        constraint elsewhere (a migrated request): the grammar catches up (or ValueError)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_request(prompt_ids, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        state = None
        if constraint is not None and constraint.kind.value != "none":
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer")
            state = self.grammar.new_state(constraint, prompt_ids[len(prompt_ids) - replay:]
                                           if replay else ())
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_ids), params, seed, next(self._arrival))
        detok = None
        if self.tokenizer is not None:
            from .tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        proc = OutputProcessor(params, eos, detok, self.max_model_len, len(prompt_ids))
        self.requests[request_id] = _Req(seq, proc, state)
        return seq

    def add_request(self, request_id: str, prompt_ids: list[int], params,
                    prefill_only: bool = False, constraint=None, cache_salt: str = "",
                    tier_blocks: int = 0, replay: int = 0) -> LayerLoad | None:
        """tier_blocks: how many leading blocks of prefix_keys(prompt, cache_salt) a lower
        tier holds (cache_salt: the tenant, whose prefix keys are its own).
        Returns the LayerLoad the caller must fill (blocks beyond the L1 hit), or None."""
        seq = self._new_seq(request_id, prompt_ids, params, constraint, replay)
        seq.stop_after_prefill, seq.cache_salt = prefill_only, cache_salt
        load = self.prefix.attach(seq, tier_blocks, tail=True)
        self.scheduler.add(seq)
        return load

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (after the running forward if it is in
        that one). Returns whether the request was known."""
        if request_id not in self.requests:
            return False
        self._between_steps(request_id, lambda: self._finish_abort(request_id))
        return True

    def _finish_abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, FinishReason.ABORT)

    def _between_steps(self, request_id: str, command: Callable[[], None]) -> None:
        """Run a command that frees a request's blocks now, or, while the running
        forward computes that request, once it has ended (end_step)."""
        if request_id in self._inflight:
            self._after_step.append((request_id, command))
        else:
            command()

    # ---- prefill-only requests (their kept blocks: port.kept_blocks) ---------------
    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept; one still in the engine
        leaves it (as abort()), after the running forward if it is in that one."""
        self._between_steps(request_id, lambda: self._release(request_id))

    def _release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:      # (a sequence left without its request: stepped forever)
            self.scheduler.finish(req.seq, req.seq.finish_reason or FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One whole step on the calling thread (tests, benchmarks, the CLI)."""
        plan = self.begin_step()
        if plan is None:
            return []
        try:
            logits = self.forward(plan)
        except BaseException:
            self.end_step(plan, None, failed=True)
            raise
        return self.end_step(plan, logits)

    def begin_step(self) -> StepPlan | None:
        """Owner: schedule the next batch and mark it in flight (None: nothing to run)."""
        batch = self.scheduler.schedule()
        if not batch:
            return None
        self._inflight = {s.seq.request_id for s in batch}
        now = time.monotonic()
        for s in batch:
            s.seq.scheduled_at = s.seq.scheduled_at or now
        return StepPlan(batch, time.perf_counter())

    def forward(self, plan: StepPlan):
        """Worker: draft proposals, the flat batch and the model forward; reads only the
        batch's sequences and writes only their KV. None when a layer load failed."""
        if self.spec is not None:
            self.spec.propose(plan.batch)      # draft forwards: fill s.drafts
        input_ids, meta, plan.sampled = build_batch(plan.batch, self.cfg)
        try:
            return self.model.forward(input_ids, meta, self.kv)
        except LoadFailed:
            return None

    def end_step(self, plan: StepPlan, logits, failed: bool = False) -> list[RequestOutput]:
        """Owner: sample and check the batch (unless its forward failed), then run the
        commands that waited for it; a request they removed gets no output of this step."""
        self._inflight = set()
        outs = []
        if logits is not None:
            outs = self.postprocess(plan.batch, plan.sampled, logits)
        elif not failed:
            self.prefix.recompute_failed_loads(plan.batch)
        waited, self._after_step = self._after_step, []
        for _rid, command in waited:
            command()
        gone = {rid for rid, _ in waited}
        outs = [o for o in outs if o.request_id not in gone]
        if self.spec is not None and not failed:   # adaptive speculation times whole steps
            self.spec.step_done(outs, time.perf_counter() - plan.t0)
        return outs

    def postprocess(self, batch, sampled, logits) -> list[RequestOutput]:
        for s in batch:
            s.seq.num_computed = s.start + s.n
            self.prefix.register(s.seq)
        V = logits.shape[-1]
        rows, inputs, r = [], [], 0   # the rows that sample one token, sampled as one batch
        for s in sampled:
            if not s.drafts:
                rows.append(r)
                inputs.append(self.sample_input(s.seq, V))
            r += s.rows if s.drafts else 1
        picked = iter(sample(logits if len(rows) == logits.shape[0] else logits[rows], inputs))
        outs, r = [], 0
        for s in sampled:
            seq, req = s.seq, self.requests[s.seq.request_id]
            if s.drafts:              # rows r .. r+k: verify the drafts
                outs.append(self.spec.verify(s, logits[r:r + s.rows]))
                r += s.rows
                continue
            res = next(picked)
            r += 1
            if req.constraint is not None:
                req.constraint.accept(res.token)   # sampled under its mask: always accepted
            outs.append(self.append_token(seq, res.token, res))
        return outs

    def sample_input(self, seq: Sequence, V: int) -> SampleInput:
        """What sampling needs of a sequence's next token (its grammar's mask, its bans)."""
        req = self.requests[seq.request_id]
        allowed = req.constraint.mask(V) if req.constraint is not None else None
        return SampleInput(seq.params, seq.seed, seq.num_tokens, seq.prompt_ids, seq.output_ids,
                           banned=fit_banned(req.proc.banned(len(seq.output_ids)), allowed),
                           allowed_mask=allowed)

    def append_token(self, seq: Sequence, token: int, res=None) -> RequestOutput:
        """Record a sampled token and run stop checks (also used for a remote first token)."""
        proc = self.requests[seq.request_id].proc
        seq.output_ids.append(token)
        text, reason, stop_reason = proc.process(token, len(seq.output_ids))
        state = self.requests[seq.request_id].constraint
        if reason is None and state is not None and state.is_terminated:
            reason = FinishReason.STOP     # the grammar is complete and took its end token
        if reason is None and seq.stop_after_prefill:
            reason = FinishReason.PREFILL_DONE
        out = RequestOutput(seq.request_id, [token], text, reason is not None, reason, stop_reason,
                            num_prompt_tokens=len(seq.prompt_ids),
                            num_output_tokens=len(seq.output_ids),
                            num_cached_tokens=seq.num_cached, spec_steps=seq.spec_steps,
                            spec_proposed=seq.spec_proposed, spec_accepted=seq.spec_accepted,
                            scheduled_at=seq.scheduled_at)
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
                "blocks_total": self.pool.num_blocks, "block_size": self.cfg.block_size,
                "blocks_evicted": self.scheduler.evicted_blocks,
                **self.pool.stats(), **self.counters}
