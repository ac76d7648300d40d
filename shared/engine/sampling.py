"""Token sampling: logits processors, then greedy or seeded random choice.

Reproducibility across batches and processes: a request's random stream is derived
from (seed, position) only, never from a shared generator, so the same request samples
the same token at the same position whatever else is in the batch and wherever it runs
(prefill samples the first token, decode the rest). Sampling uses the exponential-race
form argmax(p / q), q ~ Exp(1), which equals drawing from p.

Logprobs are reported from the model's raw distribution (log_softmax of the logits
before bias, penalties and temperature), as vLLM does by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.contracts.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): independent streams per position."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SampleInput:
    params: SamplingParams
    seed: int                        # resolved seed (never None here)
    position: int                    # index the sampled token will take in the sequence
    prompt_ids: list[int]
    output_ids: list[int]
    banned: frozenset[int] = frozenset()     # e.g. EOS while below min_tokens
    allowed_mask: torch.Tensor | None = None  # [V] bool from a grammar constraint


@dataclass(slots=True)
class SampleOutput:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def fit_banned(banned: frozenset[int], allowed_mask: torch.Tensor | None) -> frozenset[int]:
    """The ban (EOS below min_tokens) yields when the grammar can only end here."""
    if allowed_mask is None or not banned:
        return banned
    rest = allowed_mask.clone()
    rest[torch.tensor(sorted(banned), dtype=torch.long)] = False
    return banned if bool(rest.any()) else frozenset()


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids,
                    output_ids) -> torch.Tensor:
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncate(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top_k, top_p and min_p on temperature-scaled logits; removed entries -> -inf."""
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p   # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def processed_logits(logits: torch.Tensor, si: SampleInput) -> torch.Tensor:
    """The distribution the token is drawn from, as logits (temperature applied)."""
    x = apply_penalties(logits.clone(), si.params, si.prompt_ids, si.output_ids)
    if si.banned:
        x[torch.tensor(sorted(si.banned), dtype=torch.long)] = float("-inf")
    if si.allowed_mask is not None:
        x = x.masked_fill(~si.allowed_mask, float("-inf"))
    if si.params.greedy:
        return x
    return truncate(x / si.params.temperature, si.params)


def choose(x: torch.Tensor, si: SampleInput) -> int:
    if si.params.greedy:
        return int(torch.argmax(x))
    g = torch.Generator().manual_seed(stream_seed(si.seed, si.position))
    q = torch.empty_like(x).exponential_(generator=g)
    return int(torch.argmax(x.softmax(-1) / q))


def plain_greedy(si: SampleInput) -> bool:
    """Whether the row's token is its raw logits' argmax: greedy, no logprobs, nothing
    applied first (bias, penalties, bans, grammar)."""
    p = si.params
    return (p.greedy and p.logprobs is None and not si.banned and si.allowed_mask is None
            and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)


def sample(logits: torch.Tensor, inputs: list[SampleInput]) -> list[SampleOutput]:
    """logits: [B, V] float32, one row per input. The plain greedy rows' tokens come from
    one argmax over the batch (row by row, each took a copy of its logits and its own
    calls); the others are processed row by row."""
    plain = [plain_greedy(si) for si in inputs]
    fast = logits.argmax(-1).tolist() if sum(plain) > 1 else None
    out = []
    for i, (row, si) in enumerate(zip(logits, inputs)):
        if fast is not None and plain[i]:
            out.append(SampleOutput(fast[i]))
            continue
        tok = choose(processed_logits(row, si), si)
        res = SampleOutput(tok)
        if si.params.logprobs is not None:
            lp = torch.log_softmax(row, -1)
            res.logprob = float(lp[tok])
            if si.params.logprobs:
                top = torch.topk(lp, si.params.logprobs)
                res.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        out.append(res)
    return out
