"""kv_stream=auto's cost model (services/prefill/linkcost.py), event by event: a link's rate
is bytes over the time a write to it was in flight (concurrent writes counted once), and a
job streams exactly when its KV's wire time is at least the given share of its compute."""
from __future__ import annotations

import pytest

from services.prefill.linkcost import HALF_BYTES, LinkMeter

MB = 1 << 20


def test_concurrent_writes_count_their_busy_time_once():
    m = LinkMeter()
    m.begin("d", 0.0)
    m.begin("d", 0.5)
    m.end("d", 4 * MB, 1.0)
    m.end("d", 4 * MB, 1.5)          # busy 0.0..1.5: 8 MB over 1.5 s, not over 2 s
    assert m.rate("d") == pytest.approx(8 * MB / 1.5)
    m.begin("d", 10.0)               # the idle gap 1.5..10 is not the link's
    m.end("d", 8 * MB, 11.5)
    assert m.rate("d") == pytest.approx(8 * MB / 1.5)
    assert m.rate("other") is None


def test_a_failed_write_adds_no_bytes_and_a_large_transfer_outweighs_small_ones():
    m = LinkMeter()
    m.begin("d", 0.0)
    m.end("d", 0, 5.0)               # timed out: nothing measured
    assert m.rate("d") is None
    for i in range(20):              # small writes, each paying a fixed 1 ms
        m.begin("d", i)
        m.end("d", 1000, i + 0.001)
    m.begin("d", 100.0)
    m.end("d", 4 * HALF_BYTES, 100.0 + 4 * HALF_BYTES / 100e6)   # 64 MB at 100 MB/s
    assert 90e6 < m.rate("d") <= 100e6


def test_the_choice_follows_the_wire_time_against_the_compute():
    m = LinkMeter()
    assert m.choose("d", 2000, 46 * MB, 0.05) == (False, "unmeasured")
    m.computed(2000, 6.0)            # 3 ms a token
    m.begin("d", 0.0)
    m.end("d", 46 * MB, 46 * MB / 125e6)         # 1 Gbit/s: 0.39 s = 6.4% of 6 s
    assert m.choose("d", 2000, 46 * MB, 0.05)[0] is True
    assert m.choose("d", 2000, 46 * MB, 0.10)[0] is False
    fast = LinkMeter()
    fast.computed(2000, 6.0)
    fast.begin("d", 0.0)
    fast.end("d", 46 * MB, 46 * MB / 1.25e9)     # 10 Gbit/s: 0.6%
    assert fast.choose("d", 2000, 46 * MB, 0.05)[0] is False
    assert m.choose("unseen", 2000, 46 * MB, 0.05) == (False, "unmeasured")


def test_a_streamed_link_is_measured_again_every_reprobe_th_job():
    """Streamed writes are not measured (their time is the round trip): a link that gets
    streaming sends every REPROBE-th job whole, so a link that got faster is found."""
    from services.prefill.linkcost import REPROBE

    m = LinkMeter()
    m.computed(2000, 6.0)
    m.begin("d", 0.0)
    m.end("d", 46 * MB, 46 * MB / 125e6)         # measured at 1 Gbit/s: stream
    picks = [m.choose("d", 2000, 46 * MB, 0.05) for _ in range(REPROBE)]
    assert [p[0] for p in picks] == [True] * (REPROBE - 1) + [False]
    assert picks[-1][1] == "re-measure"
    for _ in range(4):                           # the link is now 10 Gbit/s, measured
        m.begin("d", 100.0)
        m.end("d", 46 * MB, 100.0 + 46 * MB / 1.25e9)
    assert m.choose("d", 2000, 46 * MB, 0.05)[0] is False
