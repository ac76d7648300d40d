"""The ports a local mesh picks for its servers (nats-server nodes, their routes) are free
and stay out of the way of this machine's outgoing connections: drawn below the kernel's
ephemeral range, so a connection made between the pick and the server's bind (a test
worker beside it, a restart's down time) cannot take one."""
from __future__ import annotations

import socket

from pdmesh.local import launch
from pdmesh.local.launch import ephemeral_low, free_port


def test_ports_are_bindable_below_the_ephemeral_range_and_spread():
    ports = [free_port() for _ in range(200)]
    low = ephemeral_low()
    assert all(launch.PORT_FLOOR <= p < low for p in ports)
    assert len(set(ports)) >= 190                 # drawn at random, not handed out in turn
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))           # free indeed


def test_a_port_someone_listens_on_is_never_given(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(launch, "PORT_FLOOR", busy)
        monkeypatch.setattr(launch, "ephemeral_low", lambda: busy + 1000)
        # the busy port drawn twice, then ports above it in turn: busy+1.. may itself be
        # someone's (this range is the ephemeral one here), so the pick is the first free
        draws = iter([busy, busy, *range(busy + 1, busy + 62)])
        monkeypatch.setattr(launch._draw, "randrange", lambda a, b: next(draws))
        port = free_port()
        assert busy < port < busy + 62
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))               # free indeed
