"""Adaptive speculation: how many drafts each decode step verifies, chosen step by step so
speculating is never slower than decoding plainly.

A step verifying k drafts for each of B decoding sequences costs one target forward over
B(k + 1) rows and k draft forwards over B rows; sequence i, whose drafts the target accepts
at rate a_i, then emits E_i(k) = (1 - a_i^(k+1)) / (1 - a_i) tokens on average (k = 0: one
token, plain decoding). Each step takes the k in 0..num_speculative_tokens that maximizes

    sum_i E_i(k) / (T(B(k + 1)) + k D(B))

where T and D are the target's and the draft's forward time as a function of rows, fitted
online (least squares with exponential forgetting, from every forward's measured time),
and a_i is the request's accept rate so far, shrunk toward the engine-wide rate while it
has few drafts behind it. Small batches of predictable text get long drafts; a low accept
rate or a large batch (the target's forward grows with its rows) gets short drafts or
none. While the model of the costs is unknown, the first steps try every k in turn; later
a step now and then tries a neighbour of the best k, so the fits follow the load.

Deterministic mode keeps num_speculative_tokens fixed: there k may depend only on the
sequence (runner.py), never on timing.
"""
from __future__ import annotations

PRIOR_DRAFTS = 8          # a new request's accept rate: this many drafts at the engine's rate
PROBE_EVERY = 32          # steps between tries of a neighbouring k


class Line:
    """t ~ a + b n, least squares with exponential forgetting."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.s = [0.0] * 5           # weights, n, n^2, t, n t

    def add(self, n: float, t: float) -> None:
        d = self.decay
        self.s = [d * x for x in self.s]
        for i, v in enumerate((1.0, n, n * n, t, n * t)):
            self.s[i] += v

    def __call__(self, n: float) -> float | None:
        w, sn, snn, st, snt = self.s
        if w < 1e-9:
            return None
        det = w * snn - sn * sn
        b = max(0.0, (w * snt - sn * st) / det) if det > 1e-9 * max(1.0, w * snn) else 0.0
        a = (st - b * sn) / w
        return max(1e-6, a + b * n)

    @property
    def spread(self) -> bool:
        """Whether the fit has seen more than one n."""
        w, sn, snn = self.s[:3]
        return w > 0 and w * snn - sn * sn > 1e-6 * max(1.0, w * snn)


def expected_tokens(a: float, k: int) -> float:
    a = min(max(a, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class AdaptiveK:
    def __init__(self, k_max: int, running, alpha0: float = 0.6):
        """running(): the sequences the scheduler runs (their count is the batch)."""
        self.k_max, self.running = k_max, running
        self.target, self.draft = Line(), Line()
        self.alpha_all = alpha0
        self.forwards = 0            # target forwards: one per engine step
        self._at = -1
        self._k = k_max
        self.chosen = [0] * (k_max + 1)   # steps that chose each k (STATS)

    # ---- observations -----------------------------------------------------------------
    def on_target(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)
        self.forwards += 1

    def on_draft(self, rows: int, seconds: float) -> None:
        self.draft.add(rows, seconds)

    def on_verified(self, proposed: int, accepted: int) -> None:
        if proposed:
            w = min(0.5, proposed / 64)
            self.alpha_all += w * (accepted / proposed - self.alpha_all)

    # ---- the decision -------------------------------------------------------------------
    def alpha(self, seq) -> float:
        return ((seq.spec_accepted + PRIOR_DRAFTS * self.alpha_all)
                / (seq.spec_proposed + PRIOR_DRAFTS))

    def k_for(self, seq) -> int:
        if self._at != self.forwards:        # once per step
            self._at = self.forwards
            self._k = self.choose()
            self.chosen[self._k] += 1
        return self._k

    def choose(self) -> int:
        seqs = [s for s in self.running() if s.output_ids]
        step = self.forwards
        if not self.target.spread or self.draft(1) is None or step < 2 * (self.k_max + 1):
            return step % (self.k_max + 1)            # learn the costs: every k in turn
        best = self.best(seqs)
        if step % PROBE_EVERY == 0 and self.k_max:    # keep the fits honest near the best
            return best + 1 if best < self.k_max and (best == 0 or step % 64) else best - 1
        return best

    def best(self, seqs) -> int:
        B = max(1, len(seqs))
        alphas = [self.alpha(s) for s in seqs] or [self.alpha_all]
        rates = []
        for k in range(self.k_max + 1):
            tokens = sum(expected_tokens(a, k) for a in alphas)
            seconds = self.target(B * (k + 1)) + k * (self.draft(B) or 0.0)
            rates.append(tokens / seconds)
        return max(range(len(rates)), key=rates.__getitem__)

    def stats(self) -> dict:
        return {"spec_k_chosen": list(self.chosen), "spec_alpha": self.alpha_all}

    @classmethod
    def attach(cls, runner) -> "AdaptiveK | None":
        """For a SpecRunner: None when k stays fixed (deterministic mode, or the engine's
        spec_adaptive off); else listening to both models' forwards."""
        cfg, eng = runner.cfg, runner.engine
        if cfg.deterministic or not getattr(cfg, "spec_adaptive", True):
            return None
        ad = cls(cfg.num_speculative_tokens, lambda: eng.scheduler.running)
        eng.model.forward_listener, runner.draft.forward_listener = ad.on_target, ad.on_draft
        return ad
