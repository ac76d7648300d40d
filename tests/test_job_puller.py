"""JobPuller (shared/jobqueue.py) on a fetch's 503: during a JetStream leader election the
consumer is there and a repair only stalls the next fetch on its timeouts (2-4 s); a
consumer that is gone also answers 503, so 503s that last get the repair."""
from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import ServiceUnavailableError

from shared import jobqueue
from shared.jobqueue import JobPuller, consumer_config


class Sub:
    async def fetch(self, batch, timeout=None):
        raise ServiceUnavailableError(code=503, description="no responders")


class Js:
    def __init__(self):
        self.calls: list[str] = []

    async def consumer_info(self, *a, **kw):
        self.calls.append("consumer_info")

    async def stream_info(self, *a, **kw):
        self.calls.append("stream_info")

    async def add_consumer(self, *a, **kw):
        self.calls.append("add_consumer")


def test_a_short_spell_of_503s_fetches_again_without_a_repair(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(jobqueue.time, "monotonic", lambda: now[0])
    js = Js()
    puller = JobPuller(js, Sub(), consumer_config(30.0, 5, 64))

    async def fetch_until(t):
        while now[0] < t:
            with pytest.raises(ServiceUnavailableError):
                await puller.fetch(1, timeout=1.0)
            now[0] += 0.5
    asyncio.run(fetch_until(1000.0 + jobqueue.UNAVAILABLE_S))
    assert js.calls == [] and puller.repairs == 0          # an election: no repair
    asyncio.run(fetch_until(1000.0 + jobqueue.UNAVAILABLE_S + 1.0))
    assert "add_consumer" in js.calls and puller.repairs == 1   # it lasts: repaired
