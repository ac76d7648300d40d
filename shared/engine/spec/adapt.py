"""Adaptive speculation: how many drafts each decode step verifies, chosen step by step
from what steps actually deliver, so speculating is never slower than decoding plainly.

What a step with k drafts gives (tokens emitted per second of the whole step: draft
forwards, the target's k + 1 rows per sequence, drafting and verification on the host)
depends on the accept rate of the text being written and on the batch (the target's
forward grows with its rows; at a large batch extra rows cost what they save). Neither is
known ahead, so each batch size class (1, 2, 3-4, 5-8, ...) keeps, for every k in
0..num_speculative_tokens (0: plain decoding), a running average of the tokens and the
seconds of its steps (engine.step timed as a whole), and steps take the k with the
highest tokens per second: a bandit over k. A class tries k = 0, 1, ... a few times each
first, while the rate rises with k (past its peak, a larger k waits for a stalest probe);
afterwards a step now and then tries a neighbour of the best k, and every few probes
the k tried least recently (a probe's step counts more than a usual one), so a change of
text or load moves the choice; a step far slower than its k's average (the machine was
busy elsewhere) counts as only SPIKE times that. Steps that compute
a prompt (their time is not decoding's) are not counted, nor the draft's catch-up over
positions decoded without drafts (runner.stale_s): a probe after a stretch of plain steps
would otherwise pay for the whole stretch and k > 0 could never win one back.

Probes cost: a neighbour of the best is usually slower, by a third or more when the best
is plain decoding at a large batch. So a class probes one step in PROBE_EVERY while its
best k is new, and half as often after each probe that left the best unchanged, down to
one step in PROBE_MAX; a change of the best starts over. And plain decoding (the first
choice) gives way only to a k whose rate beats its own by MARGIN: rates come from
different steps, and leaving plain decoding on a near tie costs (the draft catches up on
every position it missed each time it rejoins). Before these rules, on the tiny pair at
8 code requests (where plain decoding wins), the class's probe and exploration steps were
53 of ~280 and cost 13% of its time. scripts/bench_spec.py, k <= 4, two runs each way,
speedup over plain decoding before -> after: code c=8 0.86 -> 0.94, chat c=8 1.02 ->
1.10, chat c=1 1.37 -> 1.35, code c=1 1.07 -> 1.03.

Above spec_max_batch decoding sequences (when set; vLLM's speculative_disable_by_batch_size)
a step decodes plainly without asking the bandit: its steps are not counted, it probes
nothing, and the draft does not run. Off by default: at 8 requests the bandit alone
lost 4-9% on one day's CPU (code 0.91, chat 0.96) and on a slower day gave code 0.97,
chat 1.27 (docs/bench/spec_tiny-target.json), and a step without drafts is one the
anomaly monitor cannot judge.

Deterministic mode keeps num_speculative_tokens fixed: there k may depend only on the
sequence (runner.py), never on timing.
"""
from __future__ import annotations

TRIES = 2              # steps each k gets in a batch class before the bandit chooses
PROBE_EVERY = 16       # then one step in this many tries a neighbour of the best k (every
STALEST_EVERY = 4      # this many probes: the k tried least recently), while the best is
PROBE_MAX = 32         # new; each probe that keeps it doubles the interval, up to this
MARGIN = 1.10          # a k > 0 must beat plain decoding's rate by this factor
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


class Klass:
    """A batch class's arms (one per k) and its probing schedule."""
    __slots__ = ("arms", "best", "interval", "wait", "probes")

    def __init__(self, k_max: int):
        self.arms = [Arm() for _ in range(k_max + 1)]
        self.best: int | None = None
        self.interval = self.wait = PROBE_EVERY    # steps between probes; until the next
        self.probes = 0

    def best_k(self) -> int:
        """The fastest k; but from plain decoding only to a k that beats it by MARGIN
        (the draft that rejoins catches up on every position it missed, so leaving plain
        decoding on a near tie costs)."""
        arms = self.arms
        best = max(range(len(arms)), key=lambda k: arms[k].rate)
        if not self.best and best and arms[best].rate < MARGIN * arms[0].rate:
            return 0
        return best


class AdaptiveK:
    def __init__(self, k_max: int, running, max_batch: int = 0):
        """running(): the sequences the scheduler runs (those decoding are the batch);
        max_batch: above this batch steps take k = 0 uncounted (0: no limit)."""
        self.k_max, self.running, self.max_batch = k_max, running, max_batch
        self.classes: dict[int, Klass] = {}
        self.steps = 0
        self._k: int | None = None     # this step's choice (None: not chosen yet)
        self._cls = 0
        self._probe = False
        self._off = False               # this step is over max_batch: k = 0, not counted
        self.chosen = [0] * (k_max + 1)   # steps that chose each k (stats)

    @property
    def arms(self) -> dict[int, list[Arm]]:
        return {c: kl.arms for c, kl in self.classes.items()}

    def k_for(self, seq) -> int:
        """The step's k (the same for every sequence of the step)."""
        if self._k is None:
            b = sum(1 for s in self.running() if s.output_ids)
            self._off = bool(self.max_batch) and b > self.max_batch
            if self._off:
                self._k = 0
                self.chosen[0] += 1
                return 0
            self._cls = batch_class(b)
            kl = self.classes.get(self._cls)
            if kl is None:
                kl = self.classes[self._cls] = Klass(self.k_max)
            self._k = self.choose(kl)
            self.chosen[self._k] += 1
        return self._k

    def choose(self, kl: Klass) -> int:
        self.steps += 1
        self._probe = False
        arms = kl.arms
        for k, a in enumerate(arms):     # explore k = 0, 1, ... while the rate still rises
            if a.n < TRIES:
                return k
            if k and a.rate < arms[k - 1].rate:
                break                     # past the peak: the rest only as the stalest probe
        best = kl.best_k()
        if best != kl.best:              # a new best: probe often again
            kl.best, kl.interval, kl.wait = best, PROBE_EVERY, PROBE_EVERY
        kl.wait -= 1
        if kl.wait > 0 or not self.k_max:
            return best
        self._probe = True
        kl.probes += 1
        kl.wait = kl.interval = min(PROBE_MAX, kl.interval * 2)   # kept unless it changes
        if kl.probes % STALEST_EVERY == 0:
            return min((k for k in range(len(arms)) if k != best), key=lambda k: arms[k].last)
        near = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
        return min(near, key=lambda k: arms[k].last)

    def step_done(self, outs, seconds: float) -> None:
        """After engine.step: count the step against its k (unless it computed a prompt)."""
        k, self._k = self._k, None
        if k is None or not outs or self._off:
            return
        if any(o.num_output_tokens <= len(o.new_token_ids) for o in outs):
            return                          # a first token: this step computed a prompt
        arm = self.classes[self._cls].arms[k]
        arm.add(sum(len(o.new_token_ids) for o in outs), seconds, self._probe)
        arm.last = self.steps

    @classmethod
    def for_runner(cls, runner) -> "AdaptiveK | None":
        """For a SpecRunner: None when k stays fixed (deterministic mode, or the engine's
        spec_adaptive off). The runner feeds it every timed engine step (step_done)."""
        cfg, eng = runner.cfg, runner.engine
        if cfg.deterministic or not cfg.spec_adaptive:
            return None
        return cls(cfg.num_speculative_tokens, lambda: eng.scheduler.running, cfg.spec_max_batch)
