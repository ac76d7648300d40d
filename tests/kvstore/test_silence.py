"""A kvstore that stops answering costs one lookup timeout, not one per request: after a
timeout, asks are skipped but for one probe every probe_s, and the first answer ends it."""
from __future__ import annotations

from shared.kv.silence import Silence


def test_answering_peer_is_always_asked():
    s = Silence(probe_s=1.0)
    assert all(s.may_ask(t / 10) for t in range(30)) and not s.silent


def test_after_a_timeout_one_probe_per_interval_until_an_answer():
    s = Silence(probe_s=1.0)
    s.timed_out(10.0)
    assert s.silent and s.since == 10.0
    asked = [t / 10 for t in range(100, 135) if s.may_ask(t / 10)]
    assert asked == [11.0, 12.0, 13.0]               # the rest: a miss at once
    s.timed_out(13.0)                                # a probe that timed out again
    assert s.since == 10.0 and not s.may_ask(13.5) and s.may_ask(14.0)
    s.answered()                                     # back: every ask goes out
    assert not s.silent and all(s.may_ask(14.0 + t / 100) for t in range(10))
