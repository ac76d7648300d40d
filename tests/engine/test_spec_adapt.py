"""Adaptive speculation (shared/engine/spec/adapt.py): a bandit over k per batch class,
fed by timed engine steps; an engine that adapts while its output stays greedy."""
from __future__ import annotations

import time

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.spec.adapt import (
    MARGIN,
    PROBE_EVERY,
    PROBE_MAX,
    TRIES,
    AdaptiveK,
    batch_class,
)
from shared.engine.spec.runner import STEADY_CATCH_UP


class Seq:
    output_ids = [1]


class Out:
    def __init__(self, tokens):
        self.new_token_ids, self.num_output_tokens = [0] * tokens, 10 + tokens


def drive(ad: AdaptiveK, rate_of, steps: int, batch: int = 1) -> list[int]:
    """Run steps where k gives rate_of(k) tokens per second per sequence."""
    got = []
    for _ in range(steps):
        k = ad.k_for(Seq())
        assert ad.k_for(Seq()) == k            # one k per step
        got.append(k)
        ad.step_done([Out(2) for _ in range(batch)], 2 / rate_of(k))
    return got


def test_batch_classes():
    assert [batch_class(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 2, 3, 3, 4, 4]


def test_tries_k_upward_to_the_peak_then_keeps_the_fastest_and_probes():
    ad = AdaptiveK(3, lambda: [Seq()])
    got = drive(ad, lambda k: [10, 30, 20, 5][k], 3 * TRIES + 200)
    assert got[:3 * TRIES] == [0] * TRIES + [1] * TRIES + [2] * TRIES   # k=2 is past the peak
    rest = got[3 * TRIES:]
    assert rest.count(1) >= len(rest) - len(rest) // PROBE_EVERY - 1
    assert {0, 2, 3} <= set(rest)              # probes: neighbours, now and then the stalest


def test_probes_thin_out_while_the_best_holds():
    """Each probe that leaves the best unchanged doubles the wait before the next one, up
    to one step in PROBE_MAX: at a large batch a probe costs up to three plain steps."""
    ad = AdaptiveK(4, lambda: [Seq()] * 8)
    got = drive(ad, lambda k: 100 / (1 + 0.4 * k), 2 * TRIES + 40 * PROBE_MAX, batch=8)
    probes = [i for i, k in enumerate(got) if k and i >= 2 * TRIES]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] == 2 * PROBE_EVERY and gaps[-1] == PROBE_MAX
    assert len(probes) <= 40 + 4


def test_plain_decoding_gives_way_only_to_a_clear_win():
    """k=1 measured 5% faster than plain decoding (a near tie: rates come from different
    steps, and rejoining costs the draft a catch-up): plain decoding stays; 20%: k=1."""
    for gain, want in ((1.05, 0), (1.2, 1)):
        ad = AdaptiveK(1, lambda: [Seq()])
        got = drive(ad, lambda k, g=gain: 10 * g ** k, 2 * TRIES + 3 * PROBE_MAX)
        assert got[-PROBE_EVERY:].count(want) >= PROBE_EVERY - 1
        assert MARGIN > 1.05


def test_plain_decoding_wins_when_drafts_do_not_pay():
    ad = AdaptiveK(4, lambda: [Seq()] * 8)
    got = drive(ad, lambda k: 100 / (1 + 0.4 * k), 5 * TRIES + 48, batch=8)
    assert got[-PROBE_EVERY + 1:].count(0) >= PROBE_EVERY - 2


def test_the_choice_follows_a_change():
    ad = AdaptiveK(2, lambda: [Seq()])
    drive(ad, lambda k: [10, 20, 30][k], 3 * TRIES + 20)
    got = drive(ad, lambda k: [30, 20, 10][k], 200)          # the text changed
    assert got[-10:].count(0) >= 8


def test_a_probe_is_not_charged_for_the_draft_catching_up(tiny_target, tiny_draft,
                                                          tiny_prompts, device):
    """After plain steps the draft catches up on every position it missed: that time is
    the plain steps' debt, not the probed k's, or a k > 0 could never win a probe back.
    Here the catch-up forward is made to take 0.3 s; the step that pays it is charged
    only its share over the positions a speculating step would catch up anyway."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), draft_model=str(tiny_draft),
                                 num_speculative_tokens=2, num_blocks=256, threads=1,
                                 device=device))
    ad, runner = eng.spec.adapt, eng.spec
    ad.choose = lambda kl: 0 if ad.steps < 12 else 2     # 12 plain steps, then drafts
    count = ad.choose

    def choose(kl):
        ad.steps += 1
        return count(kl)
    ad.choose = choose
    forward = runner._forward

    def slow_catch_up(items):
        if any(len(t) > STEADY_CATCH_UP for _, _, t in items):
            time.sleep(0.3)
        return forward(items)
    runner._forward = slow_catch_up
    charged, step_done = [], ad.step_done

    def record(outs, seconds):
        charged.append((ad._k, seconds))
        step_done(outs, seconds)
    ad.step_done = record
    eng.generate([tiny_prompts[0]], SamplingParams(temperature=0.0, max_tokens=20,
                                                   ignore_eos=True))
    first_draft_step = next(s for k, s in charged if k)   # it caught up on 12 positions
    assert first_draft_step < 0.3, charged               # the catch-up (0.3 s) not charged


def test_over_max_batch_steps_decode_plainly_and_count_nowhere():
    """vLLM's speculative_disable_by_batch_size: above max_batch the step takes k = 0
    without the bandit (no exploration, no probes, no arm updated); at or below it the
    bandit explores as usual."""
    batch = [Seq()] * 8
    ad = AdaptiveK(3, lambda: batch, max_batch=4)
    got = drive(ad, lambda k: [10, 30, 20, 5][k], 100, batch=8)
    assert got == [0] * 100 and ad.arms == {} and ad.chosen[0] == 100
    batch[4:] = []
    assert drive(ad, lambda k: [10, 30, 20, 5][k], 2 * TRIES, batch=4) == [0] * TRIES + [1] * TRIES
    assert ad.arms[batch_class(4)][1].n == TRIES
    unlimited = AdaptiveK(3, lambda: [Seq()] * 8)
    assert drive(unlimited, lambda k: [10, 30, 20, 5][k], 2 * TRIES, batch=8)[TRIES:] == [1] * TRIES


def test_engine_runs_no_draft_over_max_batch(tiny_target, tiny_draft, tiny_prompts, device):
    """Five requests at once with spec_max_batch=4: no draft forward at all while five
    decode; once three finish (max_tokens), the other two speculate again."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), draft_model=str(tiny_draft),
                                 num_speculative_tokens=2, num_blocks=512, threads=1,
                                 spec_max_batch=4, device=device))
    drafted, forward = [], eng.spec._forward

    def count(items):
        drafted.append(len(items))
        return forward(items)
    eng.spec._forward = count
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng.generate(tiny_prompts[:5], short)
    assert drafted == [] and eng.counters["spec_steps"] == 0
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(tiny_prompts[:5]):
        eng.add_request(f"r{i}", p, short if i < 3 else long)
    while eng.has_unfinished:
        eng.step()
    assert drafted and max(drafted) <= 2 and eng.counters["spec_steps"] > 0


def test_prompt_steps_do_not_count():
    ad = AdaptiveK(1, lambda: [Seq()])
    ad.k_for(Seq())
    first = Out(1)
    first.num_output_tokens = 1
    ad.step_done([first], 5.0)
    assert all(a.n == 0 for arms in ad.arms.values() for a in arms)


def test_engine_adapts_and_greedy_output_stays(tiny_target, tiny_draft, tiny_prompts, device):
    base = dict(model=str(tiny_target), num_blocks=512, max_num_seqs=8, threads=1, device=device)
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
