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

from services.gateway.chunks import Lost
from services.gateway.dispatch import DecodeClient
from services.gateway.registry import Registry
from shared import subjects
from shared.contracts.common import Codec, ErrorCode, ErrorReply, encode
from shared.contracts.constraint import Constraint
from shared.contracts.messages import (
    DecodeSubmit,
    Heartbeat,
    Path,
    ProgressQuery,
    ProgressReply,
    SubmitAck,
    TokenChunk,
)
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
    client.chunks.progress_timeout_s, client.chunks.first_chunk_timeout_s = 0.3, 30.0

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


async def _answers(nc, sent: int, then=lambda: None):
    """d_0 answers every ProgressQuery with `sent`, then runs `then`."""
    async def progress(msg):
        q = Codec(ProgressQuery).decode(msg.data)
        await msg.respond(encode(ProgressReply(request_id=q.request_id, sent=sent)))
        then()

    await nc.subscribe(subjects.decode_progress("d_0"), cb=progress)


@pytest.mark.parametrize("sent", [3, -1])
async def test_a_silent_request_asks_and_moves_on_when_its_chunks_were_lost(nats_url, sent):
    """Chunks sent into a cut NATS node or a cut-off gateway are gone; the instance still
    heartbeats. A request that hears nothing asks it: it sent 3 chunks where 1 arrived, or
    it no longer serves the request (it ended it). Lost within a second or so, not after
    progress_timeout_s (60 s) or, before the first token, first_chunk_timeout_s (600 s)."""
    nc, reg, client, d = await _accepted(nats_url)
    client.chunks.probe_after_s, client.chunks.tick_s = 0.2, 0.05
    await _answers(nc, sent)
    hb = asyncio.ensure_future(_heartbeats(reg))
    d.queue.put_nowait(TokenChunk(request_id="r1", seq=0, token_ids=[7], finished=False))
    await client.next_chunk(d, time.monotonic() + 10)
    t0 = time.monotonic()
    with pytest.raises(Lost) as e:
        await client.next_chunk(d, time.monotonic() + 10)
    assert e.value.reason == "chunks_lost" and time.monotonic() - t0 < 5.0
    hb.cancel()
    await nc.close()


async def test_a_request_still_prefilling_asks_and_keeps_waiting(nats_url):
    """The instance answers with what arrived (no chunk sent yet: a long prompt's prefill):
    the request waits on."""
    nc, reg, client, d = await _accepted(nats_url)
    client.chunks.probe_after_s, client.chunks.tick_s = 0.2, 0.05
    await _answers(nc, 0)
    hb = asyncio.ensure_future(_heartbeats(reg))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.next_chunk(d, time.monotonic() + 10), 1.5)
    assert d.probe is not None and d.probe.sent == 0      # it did ask, and was answered
    hb.cancel()
    await nc.close()


async def test_an_answer_that_overtook_its_chunk_moves_nothing(nats_url):
    """The answer (2 sent) arrives before chunk 1, sent just before it on another
    subscription: that chunk still counts, and the request goes on."""
    nc, reg, client, d = await _accepted(nats_url)
    client.chunks.probe_after_s, client.chunks.tick_s = 0.2, 0.3
    late = TokenChunk(request_id="r1", seq=1, token_ids=[8], finished=False)
    await _answers(nc, 2, lambda: asyncio.get_running_loop().call_later(
        0.05, d.queue.put_nowait, late))
    hb = asyncio.ensure_future(_heartbeats(reg))
    d.queue.put_nowait(TokenChunk(request_id="r1", seq=0, token_ids=[7], finished=False))
    await client.next_chunk(d, time.monotonic() + 10)
    assert (await client.next_chunk(d, time.monotonic() + 10)).token_ids == [8]
    hb.cancel()
    await nc.close()


async def test_a_submission_decode_dropped_while_admitting_goes_to_another(nats_url):
    """d_0 answers ABORTED ("aborted while being admitted": its orphan sweep took this
    gateway for gone); the request goes to d_1 instead of failing with a 502."""
    nc = await nats.connect(nats_url)

    async def refusing(msg):
        sub = Codec(DecodeSubmit).decode(msg.data)
        err = ErrorReply(code=ErrorCode.ABORTED, message="aborted while being admitted",
                         request_id=sub.request_id)
        await nc.publish(msg.reply, encode(err), headers={
            "Nats-Service-Error-Code": "503", "Nats-Service-Error": err.message})

    async def accepting(msg):
        sub = Codec(DecodeSubmit).decode(msg.data)
        await msg.respond(encode(SubmitAck(request_id=sub.request_id, path=Path.COLOCATED)))

    await nc.subscribe(subjects.decode_submit("d_0"), cb=refusing)
    await nc.subscribe(subjects.decode_submit("d_1"), cb=accepting)
    reg = Registry(dead_after_s=5.0)
    for iid in ("d_0", "d_1"):
        reg.observe(Heartbeat(service="decode", instance_id=iid), time.monotonic())
    client = DecodeClient(nc, reg, "g_0", "", submit_timeout_s=5.0, request_timeout_s=20.0)
    d = await client.submit("r1", [1, 2], SamplingParams(), Constraint(), prefer="d_0")
    assert d.instance == "d_1" and d.sub.tried == {"d_0", "d_1"}
    await nc.close()
