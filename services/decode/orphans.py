"""Orphans: requests whose gateway is gone. Nobody reads their tokens, so they are aborted
(through the reclaim path, like any abort) instead of generating for nobody.

A gateway is gone when its heartbeat (pdmesh.evt.gateway.heartbeat) has been silent for
dead_after_s, measured on this process's clock; a gateway never heard from is given
dead_after_s from the request's arrival. Requests that name no gateway are never orphans.
A decode whose own event loop was held up (more than stall_s between two questions: a
loaded host) judges no one that round: the gateways' heartbeats may be waiting unread, and
a live gateway's request aborted while being admitted came back to it as a refusal.
Pure bookkeeping: the service feeds heartbeats and asks which requests to abort."""
from __future__ import annotations

from collections.abc import Iterable

from .request import DecodeRequest


class GatewayWatch:
    def __init__(self, dead_after_s: float, stall_s: float = 1.5):
        self.dead_after_s = dead_after_s
        self.stall_s = stall_s
        self.seen: dict[str, float] = {}       # gateway instance -> last heartbeat
        self.asked: float | None = None        # when orphans() was last asked

    def heard(self, gateway: str, now: float) -> None:
        self.seen[gateway] = now

    def orphans(self, live: Iterable[DecodeRequest], now: float) -> list[str]:
        stalled = self.asked is not None and now - self.asked > self.stall_s
        self.asked = now
        if stalled:
            return []
        out = []
        for r in live:
            if r.gateway and now - self.seen.get(r.gateway, r.submitted) > self.dead_after_s:
                out.append(r.request_id)
        return out
