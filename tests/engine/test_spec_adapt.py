"""Adaptive speculation (shared/engine/spec/adapt.py): the cost fits, the choice of k
from costs and accept rates, and an engine that adapts while its output stays greedy."""
from __future__ import annotations

import pytest

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.spec.adapt import AdaptiveK, Line, expected_tokens


class Seq:
    def __init__(self, proposed=0, accepted=0):
        self.spec_proposed, self.spec_accepted, self.output_ids = proposed, accepted, [1]


def test_line_fits_and_forgets():
    f = Line(decay=0.9)
    assert f(3) is None and not f.spread
    for n in (1, 2, 4, 8, 1, 16):
        f.add(n, 2.0 + 0.5 * n)
    assert f.spread and f(10) == pytest.approx(7.0, rel=1e-6)
    for _ in range(200):                  # the costs changed: the fit follows
        f.add(4, 10.0)
        f.add(8, 12.0)
    assert f(6) == pytest.approx(11.0, rel=1e-3)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def fitted(k_max, target, draft, seqs):
    ad = AdaptiveK(k_max, lambda: seqs)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        ad.target.add(n, target(n))
        ad.draft.add(n, draft(n))
    return ad


@pytest.mark.parametrize("alpha,batch,target,want", [
    (0.9, 1, lambda n: 10 + 0.05 * n, 4),     # predictable text, memory-bound: all drafts
    (0.05, 1, lambda n: 10 + 0.05 * n, 0),    # the draft is always wrong: none
    (0.6, 16, lambda n: 1 + 1.0 * n, 0),      # a big batch, rows cost: none
])
def test_best_k(alpha, batch, target, want):
    seqs = [Seq(1000, int(1000 * alpha)) for _ in range(batch)]
    ad = fitted(4, target, lambda n: 1 + 0.01 * n, seqs)
    assert ad.best(seqs) == want


def test_first_steps_try_every_k_then_probe():
    seqs = [Seq()]
    ad = AdaptiveK(2, lambda: seqs)
    got = []
    for _ in range(6):
        got.append(ad.k_for(seqs[0]))
        ad.k_for(seqs[0])                 # the same step: the same k
        ad.on_target(1 + got[-1], 0.01 * (1 + got[-1]))
        ad.on_draft(1, 0.001)
    assert got == [0, 1, 2, 0, 1, 2]


def test_engine_adapts_and_greedy_output_stays(tiny_target, tiny_draft, tiny_prompts):
    base = dict(model=str(tiny_target), num_blocks=512, max_num_seqs=8, threads=1)
    plain = LLMEngine(EngineConfig(**base))
    spec = LLMEngine(EngineConfig(**base, draft_model=str(tiny_draft), num_speculative_tokens=3))
    assert spec.spec.adapt is not None
    fixed = LLMEngine(EngineConfig(**base, draft_model=str(tiny_draft), num_speculative_tokens=3,
                                   spec_adaptive=False))
    assert fixed.spec.adapt is None
    det = LLMEngine(EngineConfig(**base, draft_model=str(tiny_draft), deterministic=True,
                                 max_num_batched_tokens=64, chunk_size=32))
    assert det.spec.adapt is None                 # k never depends on timing there
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = tiny_prompts[:6]
    want = [r["token_ids"] for r in plain.generate(prompts, p)]
    got = [r["token_ids"] for r in spec.generate(prompts, p)]
    same = sum(a == b for a, b in zip(got, want))
    assert same >= len(prompts) - 1               # GEMM rounding aside, the same greedy text
    assert sum(spec.spec.adapt.chosen) > 0 and spec.counters["spec_steps"] > 0
