"""Adaptive speculation: how many drafts each decode step verifies, chosen step by step
from what steps actually deliver, so speculating is never slower than decoding plainly.

What a step with k drafts gives (tokens emitted per second of the whole step: draft
forwards, the target's k + 1 rows per sequence, drafting and verification on the host)
depends on the accept rate of the text being written and on the batch (the target's
forward grows with its rows; at a large batch extra rows cost what they save). Neither is
known ahead, so each batch size class (1, 2, 3-4, 5-8, ...) keeps, for every k in
0..num_speculative_tokens (0: plain decoding), a running average of the tokens and the
seconds of its steps (engine.step timed as a whole), and steps take the k with the
highest tokens per second: a bandit over k. A class tries every k a few times first;
afterwards one step in PROBE_EVERY tries a neighbour of the best k, and every few probes
the k tried least recently (a probe's step counts more than a usual one), so a change of
text or load moves the choice; a step far slower than its k's average (the machine was
busy elsewhere) counts as only SPIKE times that. Steps that compute
a prompt (their time is not decoding's) are not counted.

Deterministic mode keeps num_speculative_tokens fixed: there k may depend only on the
sequence (runner.py), never on timing.
"""
from __future__ import annotations

import time

TRIES = 2              # steps each k gets in a batch class before the bandit chooses
PROBE_EVERY = 16       # then one step in this many tries a neighbour of the best k (every
STALEST_EVERY = 4      # this many probes: the k tried least recently)
DECAY = 0.93           # running averages: weight of the past per new step
PROBE_WEIGHT = 0.5     # a probe's step counts this much (its arm's average may be stale)
SPIKE = 3.0            # a step slower than this many times its k's average counts as that


def batch_class(b: int) -> int:
    return max(0, b - 1).bit_length()       # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...


class Arm:
    __slots__ = ("n", "tokens", "seconds", "last")

    def __init__(self):
        self.n, self.tokens, self.seconds, self.last = 0, 0.0, 0.0, 0

    def add(self, tokens: int, seconds: float, probe: bool = False) -> None:
        if self.n:      # a preempted step (a busy machine) must not sink its k
            seconds = min(seconds, SPIKE * self.seconds * max(1.0, tokens / self.tokens))
        d = (1 - PROBE_WEIGHT if probe else DECAY) if self.n else 0.0
        self.tokens = d * self.tokens + (1 - d) * tokens
        self.seconds = d * self.seconds + (1 - d) * seconds
        self.n += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class AdaptiveK:
    def __init__(self, k_max: int, running):
        """running(): the sequences the scheduler runs (those decoding are the batch)."""
        self.k_max, self.running = k_max, running
        self.arms: dict[int, list[Arm]] = {}
        self.steps = 0
        self._k: int | None = None     # this step's choice (None: not chosen yet)
        self._cls = 0
        self._probe = False
        self.chosen = [0] * (k_max + 1)   # steps that chose each k (stats)

    def k_for(self, seq) -> int:
        """The step's k (the same for every sequence of the step)."""
        if self._k is None:
            b = sum(1 for s in self.running() if s.output_ids)
            self._cls = batch_class(b)
            self._k = self.choose(self.arms.setdefault(self._cls, [
                Arm() for _ in range(self.k_max + 1)]))
            self.chosen[self._k] += 1
        return self._k

    def choose(self, arms: list[Arm]) -> int:
        self.steps += 1
        self._probe = False
        untried = [k for k, a in enumerate(arms) if a.n < TRIES]
        if untried:
            return untried[0]
        best = max(range(len(arms)), key=lambda k: arms[k].rate)
        if self.steps % PROBE_EVERY or not self.k_max:
            return best
        self._probe = True
        if self.steps % (PROBE_EVERY * STALEST_EVERY) == 0:
            return min((k for k in range(len(arms)) if k != best), key=lambda k: arms[k].last)
        near = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
        return min(near, key=lambda k: arms[k].last)

    def step_done(self, outs, seconds: float) -> None:
        """After engine.step: count the step against its k (unless it computed a prompt)."""
        k, self._k = self._k, None
        if k is None or not outs:
            return
        if any(o.num_output_tokens <= len(o.new_token_ids) for o in outs):
            return                          # a first token: this step computed a prompt
        arm = self.arms[self._cls][k]
        arm.add(sum(len(o.new_token_ids) for o in outs), seconds, self._probe)
        arm.last = self.steps

    @classmethod
    def attach(cls, runner) -> "AdaptiveK | None":
        """For a SpecRunner: None when k stays fixed (deterministic mode, or the engine's
        spec_adaptive off); else timing every engine step."""
        cfg, eng = runner.cfg, runner.engine
        if cfg.deterministic or not cfg.spec_adaptive:
            return None
        ad = cls(cfg.num_speculative_tokens, lambda: eng.scheduler.running)
        step = eng.step

        def timed_step():
            t = time.perf_counter()
            outs = step()
            ad.step_done(outs, time.perf_counter() - t)
            return outs

        eng.step = timed_step
        return ad
