"""Orphans (services/decode/orphans.py), event by event: a request whose gateway stopped
heartbeating is aborted; a decode whose own loop was held up judges no one that round."""
from __future__ import annotations

from services.decode.orphans import GatewayWatch
from services.decode.request import DecodeRequest, RequestStatus


def req(rid: str, gateway: str = "g_0", submitted: float = 0.0) -> DecodeRequest:
    return DecodeRequest(rid, RequestStatus.RUNNING, gateway=gateway, submitted=submitted)


def test_a_silent_gateway_s_requests_are_orphans():
    w = GatewayWatch(dead_after_s=5.0)
    w.heard("g_0", 0.0)
    live = [req("a"), req("b", gateway=""), req("c", gateway="g_1", submitted=3.0)]
    assert [w.orphans(live, t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] == [[]] * 5
    assert w.orphans(live, 5.5) == ["a"]             # g_1 never heard: 5 s from arrival
    assert w.orphans(live, 6.0) == ["a"]
    assert w.orphans(live, 6.5) == ["a"]
    assert w.orphans(live, 7.0) == ["a"]
    assert w.orphans(live, 7.5) == ["a"]
    assert w.orphans(live, 8.5) == ["a", "c"]         # (8.5 - 7.5 = 1 s: not a stall)


def test_after_its_own_stall_decode_judges_no_one_until_heartbeats_are_read():
    """The loop was held 10 s (a loaded host): the gateway's heartbeats of those 10 s are
    queued unread. The first question after the stall answers nothing; by the next, the
    queued heartbeat has been read and the request lives on."""
    w = GatewayWatch(dead_after_s=5.0)
    w.heard("g_0", 0.0)
    assert w.orphans([req("a")], 0.5) == []
    assert w.orphans([req("a")], 10.5) == []          # held up: no verdict
    w.heard("g_0", 10.6)                              # the queued heartbeat, read now
    assert w.orphans([req("a")], 11.0) == []
    assert w.orphans([req("a")], 16.0) == []          # (another stall)
    assert w.orphans([req("a")], 16.5) == ["a"]       # silent for 5.9 s since: an orphan
