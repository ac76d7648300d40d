"""A request's decode instance goes away without going silent: it restarted under the same
instance id (pdmesh up's supervisor starts a killed decode again in under a second, so its
heartbeats barely pause), or it drained past its drain_timeout_s (a rolling restart) and
ended the request with SHUTTING_DOWN. Both are a lost instance: the gateway migrates the
request at once, instead of waiting progress_timeout_s (60 s) for chunks that will never come,
or failing it. Real nats-server; a scripted decode."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.gateway.dispatch import DecodeClient, Lost
from services.gateway.registry import Registry
from shared import subjects
from shared.contracts.common import Codec, ErrorCode, ErrorReply, encode
from shared.contracts.constraint import Constraint
from shared.contracts.messages import DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk
from shared.contracts.sampling import SamplingParams

pytestmark = pytest.mark.timeout(30)


async def _accepted(nats_url):
    nc = await nats.connect(nats_url)

    async def decode(msg):
        sub = Codec(DecodeSubmit).decode(msg.data)
        await msg.respond(encode(SubmitAck(request_id=sub.request_id, path=Path.COLOCATED,
                                           incarnation="first")))

    await nc.subscribe(subjects.decode_submit("d_0"), cb=decode)
    reg = Registry(dead_after_s=5.0)
    reg.observe(Heartbeat(service="decode", instance_id="d_0", incarnation="first"),
                time.monotonic())
    client = DecodeClient(nc, reg, "g_0", "", submit_timeout_s=5.0, request_timeout_s=20.0,
                          tick_s=0.05)
    d = await client.submit("r1", [1, 2], SamplingParams(), Constraint())
    assert d.incarnation == "first"
    return nc, reg, client, d


async def _heartbeats(reg: Registry) -> None:
    """d_0, the same process, heartbeating on (a live instance)."""
    while True:
        reg.observe(Heartbeat(service="decode", instance_id="d_0", incarnation="first"),
                    time.monotonic())
        await asyncio.sleep(0.05)


async def test_a_decode_restarted_under_its_id_loses_its_requests_at_once(nats_url):
    nc, reg, client, d = await _accepted(nats_url)
    reg.observe(Heartbeat(service="decode", instance_id="d_0", incarnation="second"),
                time.monotonic())
    with pytest.raises(Lost) as e:
        await client.next_chunk(d, time.monotonic() + 10)
    assert e.value.reason == "instance_restarted"
    await nc.close()


async def test_the_same_process_heartbeating_on_keeps_its_requests(nats_url):
    nc, reg, client, d = await _accepted(nats_url)
    reg.observe(Heartbeat(service="decode", instance_id="d_0", incarnation="first"),
                time.monotonic())
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.next_chunk(d, time.monotonic() + 10), 0.5)
    await nc.close()


async def test_a_draining_decode_hands_its_requests_on(nats_url):
    nc, reg, client, d = await _accepted(nats_url)
    d.queue.put_nowait(TokenChunk(request_id="r1", finished=True, error=ErrorReply(
        code=ErrorCode.SHUTTING_DOWN, message="decode instance shut down", request_id="r1")))
    with pytest.raises(Lost) as e:
        await client.next_chunk(d, time.monotonic() + 10)
    assert e.value.reason == "instance_shutdown"
    await nc.close()


async def test_the_gateway_s_own_shutdown_is_not_handed_on(nats_url):
    nc, reg, client, d = await _accepted(nats_url)
    client.fail_all(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down")
    c = await client.next_chunk(d, time.monotonic() + 10)
    assert c.error.code is ErrorCode.SHUTTING_DOWN
    await nc.close()


async def test_a_long_prefill_is_waited_for_but_a_stalled_stream_moves_on(nats_url):
    """Before its first token a request is a prompt being prefilled (8,000 tokens take a
    minute on 2 cores): a live instance gets first_chunk_timeout_s. Once tokens flow, a
    gap of progress_timeout_s is a lost chunk and the request moves on."""
    nc, reg, client, d = await _accepted(nats_url)
    client.progress_timeout_s, client.first_chunk_timeout_s = 0.3, 30.0

    hb = asyncio.ensure_future(_heartbeats(reg))
    with pytest.raises(asyncio.TimeoutError):          # 1.5 s of prefill: still waiting
        await asyncio.wait_for(client.next_chunk(d, time.monotonic() + 10), 1.5)
    d.queue.put_nowait(TokenChunk(request_id="r1", seq=0, token_ids=[7], finished=False))
    assert (await client.next_chunk(d, time.monotonic() + 10)).token_ids == [7]
    with pytest.raises(Lost) as e:                    # then silence: lost
        await client.next_chunk(d, time.monotonic() + 10)
    assert e.value.reason == "no_progress"
    hb.cancel()
    await nc.close()


async def test_after_its_own_nats_reconnect_a_silent_request_moves_on(nats_url):
    """This gateway's NATS connection was down for a while (a partition of its host):
    chunks sent meanwhile are gone. A request whose last chunk was among them would wait
    progress_timeout_s (60 s, the compose cluster measured it); it moves on once the
    heartbeats are back (dead_after_s) and nothing came for it. One that hears a chunk
    after the reconnect is fine."""
    nc, reg, client, d = await _accepted(nats_url)
    d2 = await client.submit("r2", [1, 2], SamplingParams(), Constraint())
    reg.dead_after_s, client.tick_s = 0.4, 0.05

    hb = asyncio.ensure_future(_heartbeats(reg))
    for x, rid in ((d, "r1"), (d2, "r2")):
        x.queue.put_nowait(TokenChunk(request_id=rid, seq=0, token_ids=[7], finished=False))
        await client.next_chunk(x, time.monotonic() + 10)
    nc.stats["reconnects"] += 1                      # the connection came back just now
    client.blind()
    d2.queue.put_nowait(TokenChunk(request_id="r2", seq=1, token_ids=[8], finished=False))
    assert (await client.next_chunk(d2, time.monotonic() + 10)).token_ids == [8]
    t0 = time.monotonic()
    with pytest.raises(Lost) as e:
        await client.next_chunk(d, time.monotonic() + 10)
    assert e.value.reason == "gateway_reconnected" and time.monotonic() - t0 < 2.0
    with pytest.raises(asyncio.TimeoutError):        # r2 heard from decode: still waiting
        await asyncio.wait_for(client.next_chunk(d2, time.monotonic() + 10), 1.0)
    hb.cancel()
    await nc.close()
