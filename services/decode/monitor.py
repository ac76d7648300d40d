"""Speculative-decoding anomaly monitor: pure bookkeeping, no I/O, no clock. The service
feeds it one observation per verification step and logs or counts what it answers.

Rules (each request fires at most once, the first rule that holds):

    low_accept_length   mean accept length (tokens emitted per verification step, the
                        correction/bonus token included, as SGLang's spec_accept_length)
                        < accept_length_low, once more than min_tokens_low tokens were
                        generated: the draft is not paying for itself.
    high_accept_rate    accepted / proposed drafts > accept_rate_high, once at least
                        min_proposed_high drafts were proposed: the draft and the target
                        agree suspiciously well (same model, a degenerate repeat loop, or a
                        verifier that accepts everything). The gate on proposed drafts keeps
                        short clean outputs (a few steps that all happen to match) quiet; its
                        default, 128, matches min_tokens_low.

    repetition          the last generated tokens are one span of p <= repeat_max_period
                        tokens over and over (each token equals the one p before it),
                        judged over the last max(repeat_window, repeat_min_copies * p)
                        tokens: a degenerate loop, a phrase ("la femme, la femme, ...")
                        or a sentence (38 tokens of "L'Etoile est le 21e de l'Etoile, la
                        Marseillaise, la Cité, la Cité, la Bohème." again and again),
                        whatever drafts or does not. Judged from the tokens, so it holds
                        with speculation off too.

A step that proposed nothing is not a verification step: it updates generated_total only.
The speculative rules (the first two) apply only while speculating (spec_rules).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Rule(enum.StrEnum):
    LOW_ACCEPT_LENGTH = "low_accept_length"
    HIGH_ACCEPT_RATE = "high_accept_rate"
    REPETITION = "repetition"


RULES = tuple(Rule)


@dataclass(slots=True)
class MonitorConfig:
    min_tokens_low: int = 128         # low_accept_length: generated tokens first (strictly more)
    accept_length_low: float = 1.4
    accept_rate_high: float = 0.96
    min_proposed_high: int = 128      # high_accept_rate: proposed drafts first (at least)
    enabled: bool = True
    spec_rules: bool = True           # the acceptance rules (only while speculating)
    repeat_window: int = 128          # repetition: tokens judged at least (0: the rule off)
    repeat_max_period: int = 64       # repetition: the longest span that may repeat
    repeat_min_copies: int = 3        # repetition: a span repeats this often at least

    def __post_init__(self):
        if self.min_tokens_low < 0 or self.min_proposed_high < 1:
            raise ValueError("min_tokens_low must be >= 0 and min_proposed_high >= 1")
        if self.accept_length_low < 1.0:
            raise ValueError(f"accept_length_low must be >= 1 (a step emits at least one "
                             f"token), got {self.accept_length_low}")
        if not 0.0 < self.accept_rate_high <= 1.0:
            raise ValueError(f"accept_rate_high must be in (0, 1], got {self.accept_rate_high}")
        if self.repeat_window < 0 or not 1 <= self.repeat_max_period:
            raise ValueError("repeat_window must be >= 0 and repeat_max_period >= 1")
        if self.repeat_min_copies < 2:
            raise ValueError("repeat_min_copies must be >= 2 (a span once is not a loop)")

    @property
    def repeat_tail(self) -> int:
        """The generated tokens the repetition rule keeps: the longest span it judges."""
        return max(self.repeat_window, self.repeat_min_copies * self.repeat_max_period)


@dataclass(slots=True)
class RequestSpecStats:
    steps: int = 0          # verification steps (proposed > 0)
    proposed: int = 0       # drafted tokens
    accepted: int = 0       # drafted tokens the target accepted
    emitted: int = 0        # tokens emitted by verification steps (accepted + correction/bonus)
    generated: int = 0      # latest generated_total (all output tokens, speculative or not)
    fired: str | None = None
    tail: list[int] = field(default_factory=list)   # the last generated tokens (repetition)
    period: int = 0         # the repeating span's length when repetition fired

    @property
    def accept_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class AnomalyMonitor:
    """observe() per verification step, or observe_totals() with cumulative counters;
    forget() when the request ends."""
    config: MonitorConfig = field(default_factory=MonitorConfig)
    counts: dict[Rule, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    _stats: dict[str, RequestSpecStats] = field(default_factory=dict, repr=False)

    def observe(self, request_id: str, proposed: int, accepted: int, emitted: int,
                generated_total: int) -> str | None:
        """One verification step; returns the rule that fired for this request, only the
        first time one does (None otherwise and always when disabled)."""
        if not self.config.enabled:
            return None
        if not 0 <= accepted <= proposed or emitted < 0 or generated_total < 0:
            raise ValueError(f"bad step: proposed={proposed} accepted={accepted} "
                             f"emitted={emitted} generated_total={generated_total}")
        st = self._stats.setdefault(request_id, RequestSpecStats())
        st.generated = generated_total
        if proposed:
            st.steps += 1
            st.proposed += proposed
            st.accepted += accepted
            st.emitted += emitted
        return self._check(st)

    def observe_totals(self, request_id: str, steps: int, proposed: int, accepted: int,
                       generated_total: int) -> str | None:
        """The request's cumulative counters, as the engine reports them on every output
        (RequestOutput.spec_*): emitted = accepted + steps (one correction/bonus token per
        step, SGLang's accept length). Same answer as observe()."""
        if not self.config.enabled:
            return None
        if not (0 <= accepted <= proposed and 0 <= steps <= proposed) or generated_total < 0:
            raise ValueError(f"bad totals: steps={steps} proposed={proposed} "
                             f"accepted={accepted} generated_total={generated_total}")
        st = self._stats.setdefault(request_id, RequestSpecStats())
        st.steps, st.proposed, st.accepted = steps, proposed, accepted
        st.emitted, st.generated = accepted + steps, generated_total
        return self._check(st)

    def observe_tokens(self, request_id: str, new_ids) -> str | None:
        """Tokens a step generated; the repetition rule over the last repeat_window.
        Returns a rule the first time one fires for this request."""
        c = self.config
        if not c.enabled or not c.repeat_window:
            return None
        st = self._stats.setdefault(request_id, RequestSpecStats())
        if st.fired is not None:
            return None
        st.tail.extend(new_ids)
        del st.tail[:-c.repeat_tail]
        if len(st.tail) < c.repeat_window:
            return None
        st.period = loop_period(st.tail, c.repeat_max_period, c.repeat_window,
                                c.repeat_min_copies)
        if st.period:
            st.fired = Rule.REPETITION
            self.counts[st.fired] += 1
        return st.fired

    def _check(self, st: RequestSpecStats) -> str | None:
        if st.fired is not None or not st.steps or not self.config.spec_rules:
            return None
        st.fired = self._rule(st)
        if st.fired is not None:
            self.counts[st.fired] += 1
        return st.fired

    def forget(self, request_id: str) -> RequestSpecStats | None:
        """Drop a finished request; returns its stats (None if never observed)."""
        return self._stats.pop(request_id, None)

    def stats(self, request_id: str) -> RequestSpecStats | None:
        return self._stats.get(request_id)

    def __len__(self) -> int:
        return len(self._stats)

    def _rule(self, st: RequestSpecStats) -> str | None:
        c = self.config
        if st.generated > c.min_tokens_low and st.accept_length < c.accept_length_low:
            return Rule.LOW_ACCEPT_LENGTH
        if st.proposed >= c.min_proposed_high and st.accept_rate > c.accept_rate_high:
            return Rule.HIGH_ACCEPT_RATE
        return None


def loop_period(tail: list[int], max_period: int, window: int, copies: int) -> int:
    """The shortest p <= max_period whose last max(window, copies * p) tokens of tail are
    one span of p repeated (tail[i] == tail[i - p] over them), or 0."""
    n, last = len(tail), tail[-1]
    for p in range(1, max_period + 1):
        judged = max(window, copies * p)
        if judged > n:
            break
        # from the end: a tail that is not a loop differs near its end (most often at
        # once: the cheap test first, no generator per period)
        if tail[n - 1 - p] == last and all(tail[i] == tail[i - p]
                                          for i in range(n - 2, n - judged + p - 1, -1)):
            return p
    return 0
