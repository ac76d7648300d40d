"""Sampling parameters: every field that changes which tokens a request produces.

This struct crosses process boundaries (gateway -> decode -> prefill), so it lives in
contracts and is frozen. New fields must have defaults (older peers ignore them).
"""
from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None           # None: the engine draws one at admission
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None       # None: no logprobs; k >= 0: chosen + top-k

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field; the gateway turns it into a 400."""
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 1 << 31:
            raise ValueError(f"top_k must be in [0, 2^31) (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        # bounded both ways (NaN fails every comparison): logits / or * it stay finite
        if not 0.01 <= self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got "
                             f"{self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop must be at most 4 non-empty strings")
        if vocab_size is not None:
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            bad += [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        for t, b in (self.logit_bias or {}).items():
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
