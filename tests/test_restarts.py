"""The supervisor's restart decisions (pdmesh/local/restarts.py), event by event."""
from __future__ import annotations

import pytest

from pdmesh.local.restarts import GiveUp, Restart, RestartPolicy


def test_a_crash_is_restarted_with_doubling_backoff():
    p = RestartPolicy(limit=5, window_s=60, base_s=0.5, max_s=2.0)
    got = [p.on_exit("decode-1", t) for t in (0, 1, 2, 3)]
    assert got == [Restart(0.5, 1), Restart(1.0, 2), Restart(2.0, 3), Restart(2.0, 4)]


def test_limit_exits_within_the_window_is_a_crash_loop():
    p = RestartPolicy(limit=3, window_s=10)
    assert isinstance(p.on_exit("prefill-0", 0), Restart)
    assert isinstance(p.on_exit("prefill-0", 1), Restart)
    out = p.on_exit("prefill-0", 2)
    assert isinstance(out, GiveUp) and "prefill-0 exited 3 times within 10 s" in out.reason


def test_exits_outside_the_window_are_forgotten():
    p = RestartPolicy(limit=3, window_s=10, base_s=1, max_s=8)
    for t in (0, 8):
        p.on_exit("nats-1", t)
    assert p.on_exit("nats-1", 16) == Restart(2, 2)      # the exit at 0 has left the window
    assert p.on_exit("nats-1", 100) == Restart(1, 1)


def test_children_are_counted_apart():
    p = RestartPolicy(limit=2, window_s=60)
    p.on_exit("decode-0", 0)
    assert isinstance(p.on_exit("decode-1", 1), Restart)
    assert isinstance(p.on_exit("decode-0", 2), GiveUp)


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError):
        RestartPolicy(limit=0)
