"""A client that leaves while decode is still accepting its request: the gateway tells
decode to abort it (decode may have accepted) and forgets its token queue. Real nats-server;
a scripted decode that accepts slowly."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.gateway.dispatch import DecodeClient
from services.gateway.registry import Registry
from shared import subjects
from shared.contracts.common import Codec
from shared.contracts.constraint import Constraint
from shared.contracts.messages import Abort, DecodeSubmit, Heartbeat
from shared.contracts.sampling import SamplingParams

pytestmark = pytest.mark.timeout(30)


async def test_cancel_during_submit_aborts_at_decode_and_drops_the_queue(nats_url):
    nc = await nats.connect(nats_url)
    submitted, aborts = asyncio.Event(), []

    async def slow_decode(msg):
        Codec(DecodeSubmit).decode(msg.data)
        submitted.set()          # accepted here; the SubmitAck would come too late

    async def on_abort(msg):
        aborts.append(Codec(Abort).decode(msg.data))

    await nc.subscribe(subjects.decode_submit("d_0"), cb=slow_decode)
    await nc.subscribe(subjects.decode_abort("d_0"), cb=on_abort)
    reg = Registry(dead_after_s=5.0)
    reg.observe(Heartbeat(service="decode", instance_id="d_0"), time.monotonic())
    client = DecodeClient(nc, reg, "g_0", "", submit_timeout_s=5.0, request_timeout_s=10.0)
    task = asyncio.ensure_future(client.submit("r1", [1, 2], SamplingParams(), Constraint()))
    await asyncio.wait_for(submitted.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while not aborts and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert [(a.request_id, a.reason) for a in aborts] == [("r1", "client")]
    assert client.queues == {}
    await nc.close()
