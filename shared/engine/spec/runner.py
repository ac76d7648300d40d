"""Speculative decoding inside the engine: a small draft proposes, one target forward verifies.

Life cycle of a speculative decode step (a sequence with one pending token t at position
N-1, i.e. N = num_tokens):

  schedule  the scheduler reserves 1 + k rows and the blocks for positions N-1 .. N+k-1;
            k = lookahead(seq): num_speculative_tokens, capped so every token the step
            can emit (k + 1) fits max_tokens and the context window, then shrunk to the
            free rows and blocks (never a preemption).
  propose   draft catch-up: one chunk over the positions the draft lacks,
            [draft_computed, N), of at most `catch_up` tokens, about one target prefill
            chunk's compute (a sequence further behind, e.g. after a long remote
            prefill, only catches up and decodes plainly this step); its last row
            proposes d1. Then one-row forwards propose d2 .. dk. Greedy requests take
            the argmax of the draft's processed distribution; sampled ones draw from it
            with a (seed, position, DRAFT_SALT) stream and keep q for verification. A
            constrained request drafts under a fork of its grammar. Drafting stops
            early after an EOS/stop token or when the grammar terminates.
  forward   the target computes rows t, d1 .. dk in the same flat batch as the other
            sequences' prefill chunks and decodes (continuous batching); each row attends
            like a decode row over its own position (with the other decode rows in one
            paged-attention call; in deterministic mode through its own single-row span,
            as a deterministic decode step does), and all k+1 rows give logits.
  verify    verify() accepts a prefix of the drafts and adds the correction or bonus
            token. The tokens go through engine.append_token one by one, so EOS, stop
            strings, max_tokens and the grammar cut exactly where they would without
            speculation; the request's grammar advances only over appended tokens. One
            RequestOutput carries all of a step's tokens.

KV: the draft's KV is engine.draft_kv, indexed by the same block ids as the target's (one
block table, one allocator). After verification num_computed covers t and the accepted
drafts; draft_computed covers N plus the accepted drafts the draft was fed (d1 .. dk-1).
KV at rejected positions is overwritten by a later step. The draft trusts only draft KV
it computed itself: a prefix-cache hit, a lower-tier load or a remote prefill fills
target KV only, so the draft prefills the prompt in its first catch-up (it is small).

Determinism: in deterministic mode each verification row is bit for bit the row a
non-speculative decode step computes (its own single-row span; its matmuls in the same
fixed tiles), so greedy output is token for token the same; elsewhere rows differ only by
GEMM rounding. The draft is batch invariant there too (single-row spans, fixed tiles) and
k depends only on the sequence, so seeded sampling gives the
same tokens whatever the batch. Outside deterministic mode the draft's shapes only change
speed.

Counters per request (Sequence.spec_*, on every RequestOutput) and engine totals count
verification steps, drafts proposed and drafts accepted by the verifier.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..batch import DET_TILE, BatchMeta, SeqSpan
from ..model import Model
from ..output import OutputProcessor, RequestOutput
from ..sampling import fit_banned
from ..scheduler import Scheduled
from ..sequence import Sequence
from .adapt import AdaptiveK
from .verify import DRAFT_SALT, VerifyInput, processed_probs, spec_generator, verify

# (sequence, first position, token ids) fed to one draft forward
Item = tuple[Sequence, int, list[int]]
STEADY_CATCH_UP = 2     # positions a draft catches up per step while speculating (the
#                         pending token, and the last accepted draft it was not fed)


def _stale_share(items: list[Item]) -> float:
    """The share of a catch-up forward spent on positions beyond a speculating step's
    usual few: the prompt, or steps decoded without drafts. Adaptive k (adapt.py) does not
    charge it to the step's k: it is the cost of the steps that did not speculate."""
    rows = sum(len(t) for _, _, t in items)
    stale = sum(max(0, len(t) - STEADY_CATCH_UP) for _, _, t in items)
    return stale / rows if rows else 0.0


@dataclass(slots=True, eq=False)
class _Drafting:
    s: Scheduled
    proc: OutputProcessor
    grammar: object = None          # a fork of the request's ConstraintState, or None
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)   # q per draft (sampled)


class SpecRunner:
    def __init__(self, engine, draft: Model):
        self.engine = engine
        self.cfg = engine.cfg
        self.draft = draft
        ratio = max(1, engine.model_cfg.num_layers // draft.cfg.num_layers)
        self.catch_up = self.cfg.chunk_size * ratio
        if self.cfg.deterministic:     # one forward
            self.catch_up = min(self.catch_up, self.cfg.max_num_batched_tokens)
        self.adapt = AdaptiveK.for_runner(self)   # k per step (adapt.py); None: fixed
        self.stale_s = 0.0      # this step's draft catch-up over positions decoded plainly

    def lookahead(self, seq: Sequence) -> int:
        """Drafts a decode step of seq may verify: all k + 1 tokens it can emit must fit
        max_tokens and the context window."""
        return max(0, min(self.adapt.k_for(seq) if self.adapt else self.cfg.num_speculative_tokens,
                          seq.params.max_tokens - len(seq.output_ids) - 1,
                          self.engine.max_model_len - seq.num_tokens - 1))

    def step_done(self, outs, seconds: float) -> None:
        """After each engine step (seconds: all of it): adaptive k counts it, less this
        step's draft catch-up over positions decoded plainly (stale_s)."""
        if self.adapt is not None:
            self.adapt.step_done(outs, seconds - self.stale_s)
        self.stale_s = 0.0

    # ---- propose ------------------------------------------------------------------
    def propose(self, batch: list[Scheduled]) -> None:
        """Fill s.drafts (and s.draft_probs) of the batch's speculative decode steps."""
        self.stale_s = 0.0
        steps = [s for s in batch if s.k]
        if not steps:
            return
        catch_up = []
        for s in steps:
            # (at least the pending token: after a failed step draft_computed may cover it)
            seq, start = s.seq, min(s.seq.draft_computed, s.seq.num_tokens - 1)
            end = min(seq.num_tokens, start + self.catch_up)
            catch_up.append((seq, start, [seq.token_at(i) for i in range(start, end)]))
        t = time.perf_counter()
        rows = self._forward(catch_up)
        self.stale_s = _stale_share(catch_up) * (time.perf_counter() - t)
        live, logits = [], []
        for s, (seq, start, toks), row in zip(steps, catch_up, rows):
            seq.draft_computed = start + len(toks)
            if seq.draft_computed == seq.num_tokens:      # caught up: its row proposes d1
                req = self.engine.requests[seq.request_id]
                grammar = req.constraint.fork() if req.constraint is not None else None
                live.append(_Drafting(s, req.proc, grammar))
                logits.append(row)
        drafting = list(live)
        while live:
            more = []
            for d, row in zip(live, logits):
                if self._choose(d, row) and len(d.tokens) < d.s.k:
                    more.append(d)
            live = more
            if live:   # feed the newest draft at its position
                logits = self._forward([(d.s.seq, d.s.seq.num_tokens + len(d.tokens) - 1,
                                         d.tokens[-1:]) for d in live])
        for d in drafting:
            d.s.drafts = d.tokens
            d.s.draft_probs = torch.stack(d.probs) if d.probs else None

    def _choose(self, d: _Drafting, row: torch.Tensor) -> bool:
        """Append the next draft token from the draft's logits row; False: stop drafting."""
        seq, i = d.s.seq, len(d.tokens)
        allowed = d.grammar.mask(row.shape[-1]) if d.grammar is not None else None
        banned = fit_banned(d.proc.banned(len(seq.output_ids) + i), allowed)
        q = processed_probs(row, seq.params, seq.prompt_ids, seq.output_ids + d.tokens,
                            banned, allowed)                               # [V]
        if seq.params.greedy:
            tok = int(torch.argmax(q))
        else:   # the exponential race draws from q (as sampling.choose does)
            g = spec_generator(seq.seed, seq.num_tokens + i, DRAFT_SALT)
            tok = int(torch.argmax(q / torch.empty_like(q).exponential_(generator=g)))
            d.probs.append(q)
        d.tokens.append(tok)
        if d.grammar is not None:
            d.grammar.accept(tok)
            if d.grammar.is_terminated:
                return False
        return tok not in d.proc.eos_ids and tok not in seq.params.stop_token_ids

    def _forward(self, items: list[Item]) -> torch.Tensor:
        """One draft forward over items; logits [len(items), V] of each item's last row.
        Deterministic mode gives every row its own span (its matmuls in fixed tiles, so the
        forward's size changes no bit); otherwise lone rows of several sequences share the
        batched paged-attention path and chunks attend per sequence."""
        det = self.cfg.deterministic
        bs = self.cfg.block_size
        single = [] if det else [i for i, (_, _, t) in enumerate(items) if len(t) == 1]
        if len(single) == 1:
            single = []
        chunks = [i for i in range(len(items)) if i not in set(single)]
        ids, pos, slots, spans, last = [], [], [], [], [0] * len(items)
        row = 0
        for i in single + chunks:
            seq, start, toks = items[i]
            p = range(start, start + len(toks))
            ids += toks
            pos += p
            slots += [seq.block_table[j // bs] * bs + j % bs for j in p]
            if i in chunks:
                bt = torch.tensor(seq.block_table, dtype=torch.long)
                ctx_slots = (bt.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:p.stop]
                if det:
                    spans += [SeqSpan(row + j, 1, q + 1, ctx_slots[:q + 1])
                              for j, q in enumerate(p)]
                else:
                    spans.append(SeqSpan(row, len(toks), p.stop, ctx_slots))
            row += len(toks)
            last[i] = row - 1
        meta = BatchMeta(positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
                         spans=spans, logits_rows=torch.tensor(last, dtype=torch.long))
        if single:
            nb = max(len(items[i][0].block_table) for i in single)
            meta.num_decode = len(single)
            meta.block_tables = torch.tensor(
                [items[i][0].block_table + [0] * (nb - len(items[i][0].block_table))
                 for i in single], dtype=torch.int32)
            meta.context_lens = torch.tensor([items[i][1] + 1 for i in single], dtype=torch.int32)
        if det:  # fixed GEMM shapes: tiles of DET_TILE rows (model.linear)
            meta.det_tile = DET_TILE
        return self.draft.forward(torch.tensor(ids, dtype=torch.long), meta, self.engine.draft_kv)

    # ---- verify -------------------------------------------------------------------
    def verify(self, s: Scheduled, logits: torch.Tensor) -> RequestOutput:
        """logits: [k+1, V], the target's rows t, d1 .. dk. Appends the emitted tokens
        (until the request finishes) and returns them as one output."""
        eng = self.engine
        seq, req = s.seq, eng.requests[s.seq.request_id]
        k, N = len(s.drafts), seq.num_tokens
        masks = req.constraint.masks_for(s.drafts) if req.constraint is not None else None
        banned = [fit_banned(req.proc.banned(len(seq.output_ids) + i),
                             None if masks is None else masks[i]) for i in range(k + 1)]
        res = verify(s.drafts, s.draft_probs, logits,
                     VerifyInput(seq.params, seq.seed, N, seq.prompt_ids, seq.output_ids,
                                 banned, masks))
        a = res.num_accepted
        seq.num_computed += a                    # t's KV, then the accepted drafts'
        seq.draft_computed = N + min(a, k - 1)   # the draft was fed d1 .. dk-1
        for name, v in (("spec_steps", 1), ("spec_proposed", k), ("spec_accepted", a)):
            setattr(seq, name, getattr(seq, name) + v)
            eng.counters[name] += v
        outs = []
        for o in res.outputs:
            if req.constraint is not None:
                req.constraint.accept(o.token)   # verified under its mask: always accepted
            outs.append(eng.append_token(seq, o.token, o))
            if outs[-1].finished:
                break
        return merge(outs)


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of one request (the last one's state)."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids],
                               text="".join(o.text for o in outs),
                               logprobs=[lp for o in outs for lp in o.logprobs])
