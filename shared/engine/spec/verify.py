"""Verify k drafted tokens against the target's k+1 logit rows.

Greedy: accept the longest prefix where draft == argmax of the processed target row, then
emit the target's argmax at the first mismatch (or the bonus row after all k): exactly the
tokens non-speculative greedy decoding produces.

Sampled (Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability
min(1, p(x_i) / q(x_i)); on the first rejection draw from the residual norm(max(0, p - q)),
which makes the emitted token exactly p-distributed; if all k are accepted, draw the bonus
token from p at row k. Lossless only if x_i really was drawn from q = draft_probs[i].

Both p and q come from `processed_probs`, so penalties, logit_bias, banned ids, the grammar
mask, temperature and top-k/top-p/min-p apply to both sides alike. Row i sees
output_ids + drafts[:i] (penalties move as drafts are accepted).

Randomness comes from (seed, position, salt) only, never from a shared generator, so a
request verifies the same way whatever else is in the batch. Salts keep the accept uniform
and the residual/bonus draw independent of each other and of the plain stream
`stream_seed(seed, position)` that `sampling.choose` uses: a draft that samples its proposals
with the plain stream (or with DRAFT_SALT) stays independent of the verifier's draws.

Logprobs, when asked for, are those of the raw target row (as `sampling.sample` reports).
Inputs are moved to CPU float32 (the seeded generators are CPU generators).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.contracts.sampling import SamplingParams

from ..sampling import SampleInput, SampleOutput, processed_logits, stream_seed

ACCEPT_SALT = 0x5EC_ACC    # uniform for the accept test at each draft position
DRAW_SALT = 0x5EC_D4A      # residual draw after a rejection, bonus draw after full acceptance
DRAFT_SALT = 0x5EC_D2F     # free for the draft's own proposals


def spec_generator(seed: int, position: int, salt: int) -> torch.Generator:
    """A CPU generator for one (seed, position, salt): independent streams per salt."""
    return torch.Generator().manual_seed(stream_seed(stream_seed(seed, position), salt))


@dataclass(slots=True)
class VerifyInput:
    params: SamplingParams
    seed: int                                   # resolved seed
    position: int                               # absolute position of drafts[0]
    prompt_ids: list[int]
    output_ids: list[int]                       # before drafts[0]
    banned: Sequence[frozenset[int]] | None = None   # k+1 sets, row i after drafts[:i]
    allowed_masks: torch.Tensor | None = None   # [k+1, V] bool, ConstraintState.masks_for

    def row(self, i: int, drafts: Sequence[int]) -> SampleInput:
        """The SampleInput normal sampling would build for row i (after drafts[:i])."""
        return SampleInput(
            self.params, self.seed, self.position + i, self.prompt_ids,
            list(self.output_ids) + list(drafts[:i]),
            banned=self.banned[i] if self.banned is not None else frozenset(),
            allowed_mask=self.allowed_masks[i] if self.allowed_masks is not None else None)


@dataclass(slots=True)
class VerifyResult:
    outputs: list[SampleOutput]    # accepted drafts, then the correction or bonus token
    num_accepted: int              # accepted drafts (len(outputs) - 1)

    @property
    def tokens(self) -> list[int]:
        return [o.token for o in self.outputs]


def processed_probs(logits_row: torch.Tensor, params: SamplingParams, prompt_ids=(),
                    output_ids=(), banned: frozenset[int] = frozenset(),
                    allowed_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[V] -> [V] float32: the distribution a token is drawn from at this row (one-hot on
    the argmax when greedy). Use it for the draft's q as well as the target's p."""
    si = SampleInput(params, 0, 0, list(prompt_ids), list(output_ids), banned, allowed_mask)
    return _probs(processed_logits(logits_row.float().cpu(), si), params)


def verify(draft_tokens: Sequence[int], draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, vi: VerifyInput) -> VerifyResult:
    """draft_probs: [k, V] (None allowed when greedy); target_logits: [k+1, V]."""
    k = len(draft_tokens)
    target_logits = target_logits.float().cpu()
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k+1={k + 1}, V], "
                         f"got {tuple(target_logits.shape)}")
    greedy = vi.params.greedy
    if not greedy:
        if draft_probs is None or tuple(draft_probs.shape) != (k, target_logits.shape[1]):
            got = None if draft_probs is None else tuple(draft_probs.shape)
            raise ValueError(f"draft_probs must be [k={k}, V] when sampling, got {got}")
        draft_probs = draft_probs.float().cpu()
    tokens = []
    for i in range(k + 1):
        x = processed_logits(target_logits[i], vi.row(i, draft_tokens))
        if greedy:
            tok = int(torch.argmax(x))
            tokens.append(tok)
            if i == k or tok != draft_tokens[i]:
                break
            continue
        p = _probs(x, vi.params)
        if i == k:                                    # bonus token
            tokens.append(_race(p, vi, i))
            break
        d, q = int(draft_tokens[i]), draft_probs[i]
        if _accepts(p[d], q[d], vi, i):
            tokens.append(d)
            continue
        tokens.append(_race(residual(p, q), vi, i))   # correction
        break
    outs = [_output(target_logits[i], t, vi.params) for i, t in enumerate(tokens)]
    return VerifyResult(outs, len(tokens) - 1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (the race does not need it). Falls back to p when the
    residual vanishes (p == q up to rounding, so a rejection was a rounding artefact)."""
    r = (p - q).clamp_min(0.0)
    return r if float(r.sum()) > 1e-9 else p


def _accepts(p_x: torch.Tensor, q_x: torch.Tensor, vi: VerifyInput, i: int) -> bool:
    # u ~ U[0, 1): P(u * q < p) = min(1, p / q); p == 0 never accepts
    u = torch.rand((), generator=spec_generator(vi.seed, vi.position + i, ACCEPT_SALT))
    return bool(u * q_x < p_x)


def _race(weights: torch.Tensor, vi: VerifyInput, i: int) -> int:
    """Draw from weights / sum(weights): argmax(w / E), E ~ Exp(1) (as sampling.choose)."""
    g = spec_generator(vi.seed, vi.position + i, DRAW_SALT)
    e = torch.empty_like(weights).exponential_(generator=g)
    return int(torch.argmax(weights / e))


def _probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.greedy:
        return torch.zeros_like(x).scatter_(0, torch.argmax(x).view(1), 1.0)
    return x.softmax(-1)


def _output(row: torch.Tensor, tok: int, params: SamplingParams) -> SampleOutput:
    res = SampleOutput(tok)
    if params.logprobs is not None:
        lp = torch.log_softmax(row, -1)
        res.logprob = float(lp[tok])
        if params.logprobs:
            top = torch.topk(lp, params.logprobs)
            res.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
    return res
