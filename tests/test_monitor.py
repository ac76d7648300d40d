"""Speculative anomaly monitor: each rule fires once, past its gate, and only then."""
from __future__ import annotations

import pytest

from services.decode.monitor import (
    AnomalyMonitor,
    MonitorConfig,
    RequestSpecStats,
    Rule,
)


def run(mon, rid, steps, k, accepted, start=1):
    """`steps` verification steps of k drafts with `accepted` accepted (+1 bonus/correction);
    returns every non-None answer."""
    fired, total = [], start
    for _ in range(steps):
        total += accepted + 1
        r = mon.observe(rid, k, accepted, accepted + 1, total)
        if r is not None:
            fired.append(r)
    return fired


def test_stats_properties():
    st = RequestSpecStats(steps=4, proposed=16, accepted=8, emitted=12)
    assert st.accept_length == 3.0 and st.accept_rate == 0.5
    assert RequestSpecStats().accept_length == 0.0 and RequestSpecStats().accept_rate == 0.0


def test_low_accept_length_fires_once_after_the_token_gate():
    mon = AnomalyMonitor()
    # accept length 1.0 (every draft rejected): quiet until more than 128 tokens
    fired = []
    for i in range(1, 200):
        r = mon.observe("a", 4, 0, 1, 1 + i)
        if r:
            fired.append((r, 1 + i))
    assert fired == [(Rule.LOW_ACCEPT_LENGTH, 129)]
    assert mon.counts == {Rule.LOW_ACCEPT_LENGTH: 1, Rule.HIGH_ACCEPT_RATE: 0, Rule.REPETITION: 0}


def test_healthy_request_stays_quiet():
    mon = AnomalyMonitor()
    assert run(mon, "a", 200, 4, 2) == []     # accept length 3, rate 0.5
    st = mon.stats("a")
    assert st.accept_length == 3.0 and st.accept_rate == 0.5 and st.steps == 200


def test_high_accept_rate_needs_enough_proposed_drafts():
    mon = AnomalyMonitor()
    assert run(mon, "short", 31, 4, 4) == []          # 124 proposed, all accepted: clean
    assert mon.observe("short", 4, 4, 5, 200) == Rule.HIGH_ACCEPT_RATE   # 128th proposed
    assert run(mon, "long", 100, 4, 4) == [Rule.HIGH_ACCEPT_RATE]
    assert mon.counts[Rule.HIGH_ACCEPT_RATE] == 2


def test_rate_at_the_threshold_does_not_fire():
    mon = AnomalyMonitor(MonitorConfig(accept_rate_high=0.75))
    assert run(mon, "a", 100, 4, 3) == []             # exactly 0.75: not above


def test_steps_without_drafts_are_not_verification_steps():
    mon = AnomalyMonitor()
    for i in range(300):
        assert mon.observe("a", 0, 0, 1, i + 1) is None
    assert mon.stats("a").steps == 0
    # the first real step sees the generated count so far
    assert mon.observe("a", 4, 0, 1, 301) == Rule.LOW_ACCEPT_LENGTH


def test_forget_and_disabled():
    mon = AnomalyMonitor()
    run(mon, "a", 5, 4, 1)
    assert len(mon) == 1 and mon.forget("a").steps == 5 and len(mon) == 0
    assert mon.forget("a") is None
    off = AnomalyMonitor(MonitorConfig(enabled=False))
    assert run(off, "a", 300, 4, 0) == [] and len(off) == 0


def test_bad_input_is_refused():
    mon = AnomalyMonitor()
    with pytest.raises(ValueError):
        mon.observe("a", 2, 3, 4, 10)
    for bad in (dict(accept_rate_high=1.5), dict(accept_length_low=0.5),
                dict(min_proposed_high=0), dict(min_tokens_low=-1)):
        with pytest.raises(ValueError):
            MonitorConfig(**bad)


def test_cumulative_totals_answer_like_steps():
    """observe_totals (the engine's cumulative RequestOutput.spec_* counters) fires at the
    same point as per-step observe; outputs without a new step only move generated."""
    steps, totals = AnomalyMonitor(), AnomalyMonitor()
    n = proposed = accepted = 0
    gen = 1
    for i in range(300):
        a = (0, 1, 0, 0)[i % 4]        # accept length 1.25: low_accept_length after 128
        gen += a + 1
        n, proposed, accepted = n + 1, proposed + 4, accepted + a
        want = steps.observe("r", 4, a, a + 1, gen)
        assert totals.observe_totals("r", n, proposed, accepted, gen) == want
        assert totals.observe_totals("r", n, proposed, accepted, gen) is None   # no new step
        if want is not None:
            assert (want, gen) == (Rule.LOW_ACCEPT_LENGTH, 129)
    assert totals.stats("r").accept_length == steps.stats("r").accept_length == 1.25
    assert totals.counts == steps.counts
    assert AnomalyMonitor().observe_totals("q", 0, 0, 0, 400) is None   # never speculated
    with pytest.raises(ValueError):
        AnomalyMonitor().observe_totals("q", 1, 4, 5, 10)


def test_thresholds_come_from_the_drafts_calibration_unless_set(tiny_target, tiny_draft):
    from services.decode.config import DecodeConfig
    from shared.settings import build

    def config(**flat) -> DecodeConfig:
        return build(DecodeConfig, {"model": str(tiny_target)} | flat)

    cal = config(draft_model=str(tiny_draft)).monitor_config()
    assert (cal.accept_length_low, cal.accept_rate_high) == (1.1, 0.96)
    flag = config(draft_model=str(tiny_draft), monitor_accept_length_low=1.4).monitor_config()
    assert flag.accept_length_low == 1.4
    none = config().monitor_config()
    assert (none.accept_length_low, none.accept_rate_high) == (1.4, 0.96)


def test_a_loop_fires_repetition_once_its_window_is_one_span_repeated():
    """"la femme, la femme, ..." as tokens: quiet while the window holds anything else,
    fires once the last 128 tokens are a 3-token span over and over, and only once."""
    mon = AnomalyMonitor(MonitorConfig(spec_rules=False))
    text = list(range(100, 160))                    # an answer, then a loop
    loop = [7, 8, 9] * 80
    fired = [(i, r) for i, t in enumerate(text + loop) if (r := mon.observe_tokens("a", [t]))]
    assert fired == [(len(text) + 128 - 1, Rule.REPETITION)]
    assert mon.stats("a").period == 3 and mon.counts[Rule.REPETITION] == 1


def test_repetitive_but_not_looping_text_is_quiet():
    """Code repeats itself (a table of similar lines) without one span repeating: a line
    that differs anywhere (a counter) breaks the period, spans longer than
    repeat_max_period do not count, and a long span twice is a quote, not a loop."""
    mon = AnomalyMonitor(MonitorConfig(spec_rules=False))
    rows = [t for i in range(60) for t in (11, 12, 13, 1000 + i, 14)]      # x[i] = i rows
    long_span = list(range(200, 270)) * 6                                    # 70-token span
    twice = list(range(300, 360)) * 2 + list(range(400, 500))               # 60 tokens twice
    assert not any(mon.observe_tokens("code", [t]) for t in rows)
    assert not any(mon.observe_tokens("long", [t]) for t in long_span)
    assert not any(mon.observe_tokens("twice", [t]) for t in twice)


@pytest.mark.parametrize("period", [38, 50, 64])
def test_a_sentence_loop_fires_once_it_repeats_three_times(period):
    """The default model's own loop at temperature 0.2 ("L'Etoile est le 21e de l'Etoile,
    la Marseillaise, la Cité, la Cité, la Bohème.\n\n" again and again: 38 tokens) ran
    to the 512-token cap while the rule judged spans of 32 tokens at most. A sentence
    fires once it fills the window (128 tokens) and repeats three times."""
    mon = AnomalyMonitor(MonitorConfig(spec_rules=False))
    text = list(range(100, 160))
    loop = list(range(1000, 1000 + period)) * 8
    fired = [(i, r) for i, t in enumerate(text + loop) if (r := mon.observe_tokens("a", [t]))]
    assert fired == [(len(text) + max(128, 3 * period) - 1, Rule.REPETITION)]
    assert mon.stats("a").period == period
    off = AnomalyMonitor(MonitorConfig(repeat_window=0))
    assert not any(off.observe_tokens("a", [7]) for _ in range(300))


def test_repetition_holds_without_speculation_and_the_spec_rules_do_not():
    mon = AnomalyMonitor(MonitorConfig(spec_rules=False))
    assert all(mon.observe("a", 4, 0, 1, 1 + i) is None for i in range(300))   # n-gram drafts
    assert mon.observe_tokens("b", [5] * 128) == Rule.REPETITION
