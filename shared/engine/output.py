"""Per-request output processing: detokenize, check stop conditions, release text.

Stop strings are matched on text, not tokens, so a stop string may end in the middle of
a token (or span several); the emitted text is cut exactly where the stop string starts.
While streaming, the last len(longest stop) - 1 characters are held back, because they
may turn out to be the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.contracts.messages import FinishReason
from shared.contracts.sampling import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]                # one or more (a speculative step emits several)
    text: str = ""                          # new text since the last output
    finished: bool = False
    finish_reason: str | None = None        # a FinishReason
    stop_reason: str | int | None = None    # the stop string or token id that matched
    logprobs: list = field(default_factory=list)   # [(token, logprob, top)] per new token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0              # prompt tokens served from a prefix cache
    # speculative decoding, cumulative for the request: verification steps, drafts
    # proposed, drafts accepted (accept length = (accepted + steps) / steps)
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    scheduled_at: float = 0.0               # monotonic time of its first step here (0: none)


class OutputProcessor:
    """Owns one request's detokenizer and stop state."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], detok, max_len: int,
                 prompt_len: int):
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.detok = detok                 # IncrementalDetokenizer or None (ids only)
        self.max_len = max_len
        self.prompt_len = prompt_len
        self.text = ""                     # all text so far (before any stop cut)
        self.sent = 0                      # characters already released
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def banned(self, num_output: int) -> frozenset[int]:
        """Tokens that may not be sampled after num_output tokens (EOS and stop ids
        while fewer than min_tokens have been generated)."""
        if num_output < self.params.min_tokens:
            return self.eos_ids | frozenset(self.params.stop_token_ids)
        return frozenset()

    def process(self, token: int, num_output: int) -> tuple[str, str | None, str | int | None]:
        """Feed one sampled token; returns (text to release, finish_reason, stop_reason)."""
        p = self.params
        if token in self.eos_ids or token in p.stop_token_ids:  # (banned below min_tokens)
            return self._flush(), FinishReason.STOP, (None if token in self.eos_ids else token)
        if self.detok is not None:
            self.text += self.detok.step(token)
        if p.stop and num_output >= p.min_tokens:
            for s in p.stop:  # a match cannot start in released text (see hold)
                i = self.text.find(s, self.sent)
                if i != -1:
                    end = i + len(s) if p.include_stop_str_in_output else i
                    self.text = self.text[:end]
                    return self._flush(), FinishReason.STOP, s
        if num_output >= p.max_tokens or self.prompt_len + num_output >= self.max_len:
            return self._flush(), FinishReason.LENGTH, None
        upto = len(self.text) - self.hold if p.stop else len(self.text)
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out, None, None

    def _flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
