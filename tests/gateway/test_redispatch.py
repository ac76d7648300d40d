"""Invariant 5 at the gateway: a request decode aborts for an acceptance anomaly is sent
again, same prompt, params (seed) and constraint, to an instance that has not had it,
while nothing of it reached the client; a stream that already sent content ends with an
anomaly_detected error event that says to retry; re-dispatches are bounded; the spec
counters reach `usage` and /metrics. Real gateway and nats-server, scripted decode
instances."""
from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from shared import subjects
from shared.contracts.common import Codec, ErrorCode, ErrorReply, encode
from shared.contracts.messages import DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 50, "seed": 7,
        "temperature": 0.5}
SPEC = dict(spec_steps=4, spec_proposed=16, spec_accepted=8)    # length 3.0, rate 0.5


def good(sub: DecodeSubmit) -> list[TokenChunk]:
    return [TokenChunk(request_id=sub.request_id, token_ids=[5], text="good ", seq=i,
                       completion_tokens=i + 1, finished=i == 2,
                       finish_reason="length" if i == 2 else None, **SPEC) for i in range(3)]


def anomaly(after: int, rule: str = "low_accept_length"):
    def script(sub: DecodeSubmit) -> list[TokenChunk]:
        chunks = [TokenChunk(request_id=sub.request_id, token_ids=[6], text="bad ", seq=i)
                  for i in range(after)]
        err = ErrorReply(code=ErrorCode.ANOMALY, message="speculative decoding acceptance "
                         "anomaly", request_id=sub.request_id)
        return chunks + [TokenChunk(request_id=sub.request_id, finished=True,
                                    finish_reason="abort", error=err, seq=after,
                                    anomaly_rule=rule)]
    return script


class FakeDecode:
    """Heartbeats (d_0 looks emptier, so it is chosen first), accepts every submit and
    plays its script's chunks."""

    def __init__(self, nc, iid: str, blocks_free: int, script):
        self.nc, self.iid, self.blocks_free, self.script = nc, iid, blocks_free, script
        self.subs: list[DecodeSubmit] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.decode_submit(self.iid), cb=self.on_submit)
        await self.beat()

    async def beat(self) -> None:
        await self.nc.publish(subjects.heartbeat("decode"), encode(Heartbeat(
            service="decode", instance_id=self.iid, blocks_free=self.blocks_free,
            max_model_len=4096, ts=time.time())))

    async def on_submit(self, msg) -> None:
        sub = Codec(DecodeSubmit).decode(msg.data)
        self.subs.append(sub)
        await msg.respond(encode(SubmitAck(request_id=sub.request_id, path=Path.PD)))
        for c in self.script(sub):
            await self.nc.publish(sub.reply_subject, encode(c))


@pytest.fixture
async def mesh(nats_url, spec, gateway_model_dir):
    """(http client, d_0, d_1): a gateway (max_redispatch 2) and two scripted decode
    instances; a test sets their .script."""
    nc = await nats.connect(nats_url)
    d0 = FakeDecode(nc, "d_0", 1000, good)
    d1 = FakeDecode(nc, "d_1", 10, good)
    cfg = GatewayConfig(model=str(gateway_model_dir), nats_url=nats_url, request_timeout_s=20,
                        max_redispatch=2)
    async with TestClient(TestServer(create_app(cfg, spec))) as http:
        for d in (d0, d1):
            await d.start()

        async def beats():
            while True:
                for d in (d0, d1):
                    await d.beat()
                await asyncio.sleep(0.2)
        task = asyncio.ensure_future(beats())
        registry = http.server.app[GATEWAY].registry
        deadline = time.monotonic() + 10
        while len(registry.alive(time.monotonic())) < 2:
            assert time.monotonic() < deadline, "the gateway saw no decode heartbeats"
            await asyncio.sleep(0.05)
        try:
            yield http, d0, d1
        finally:
            task.cancel()
            await nc.close()


async def metrics(http) -> str:
    return await (await http.get("/metrics")).text()


async def test_anomaly_before_anything_was_sent_is_redispatched(mesh):
    http, d0, d1 = mesh
    d0.script = anomaly(after=2)
    r = await http.post(CHAT, json=BODY)
    body = await r.json()
    assert r.status == 200, body
    assert body["choices"][0]["message"]["content"] == "good good good "
    assert r.headers["x-pdmesh-decode"] == "d_1"
    assert body["usage"]["spec_accept_length"] == 3.0 and body["usage"]["spec_accept_rate"] == 0.5
    first, again = d0.subs[0], d1.subs[0]
    assert again.request_id != first.request_id
    assert (again.prompt_ids, again.params, again.constraint) == \
        (first.prompt_ids, first.params, first.constraint)
    assert first.params.seed == 7
    text = await metrics(http)
    assert "pdmesh_redispatches_total 1" in text
    assert 'pdmesh_anomaly_aborts_total{rule="low_accept_length"} 1' in text
    assert "pdmesh_spec_accept_length_count 1" in text


async def test_stream_that_sent_content_gets_an_error_event_with_a_retry_hint(mesh):
    http, d0, d1 = mesh
    d0.script = anomaly(after=2)
    r = await http.post(CHAT, json=BODY | {"stream": True})
    assert r.status == 200
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                      if "choices" in e)
    err = events[-1]["error"]
    assert content == "bad bad "
    assert err["code"] == "anomaly_detected" and "retry" in err["message"]
    assert d1.subs == []
    assert "pdmesh_redispatches_total 0" in await metrics(http)


async def test_stream_with_nothing_sent_yet_is_restarted_transparently(mesh):
    http, d0, d1 = mesh
    d0.script = anomaly(after=0)
    r = await http.post(CHAT, json=BODY | {"stream": True,
                                           "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any("error" in e for e in events)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                      if e.get("choices"))
    assert content == "good good good "
    assert events[-1]["usage"]["spec_accept_length"] == 3.0
    assert len(d1.subs) == 1


async def test_redispatch_is_bounded_and_the_client_is_told_to_retry(mesh):
    http, d0, d1 = mesh
    d0.script = d1.script = anomaly(after=1)
    r = await http.post(CHAT, json=BODY)          # d_0, then d_1; nobody else is left
    err = (await r.json())["error"]
    assert r.status == 503 and err["code"] == "anomaly_detected" and "retry" in err["message"]
    assert len(d0.subs) == len(d1.subs) == 1
    http.server.app[GATEWAY].client.max_redispatch = 0
    r = await http.post(CHAT, json=BODY)
    assert r.status == 503 and len(d1.subs) == 1  # not re-dispatched at all
    text = await metrics(http)
    assert "pdmesh_redispatches_total 1" in text
    assert 'pdmesh_anomaly_aborts_total{rule="low_accept_length"} 3' in text


async def test_a_loop_is_sampled_afresh_on_any_instance(mesh):
    """A repetition loop is the output, not the instance: re-dispatched with a new seed
    (the client set none), and the same instance may take it."""
    http, d0, d1 = mesh
    calls = []

    def loop_once(sub):
        calls.append(sub)
        return anomaly(after=2, rule="repetition")(sub) if len(calls) == 1 else good(sub)
    d0.script = d1.script = loop_once
    body = {k: v for k, v in BODY.items() if k != "seed"}
    r = await http.post(CHAT, json=body)
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == \
        "good good good "
    first, again = calls
    assert again.params.seed != first.params.seed and again.request_id != first.request_id
    assert 'pdmesh_anomaly_aborts_total{rule="repetition"} 1' in await metrics(http)


@pytest.mark.parametrize("fields", [{"seed": 7}, {"temperature": 0}])
async def test_a_loop_that_would_come_back_is_cut_short_not_failed(mesh, fields):
    """Greedy or client-seeded, a fresh dispatch would loop again: the answer is what came
    before the loop, finish_reason "length", stop_reason "repetition" (not a 503)."""
    http, d0, d1 = mesh
    d0.script = d1.script = anomaly(after=2, rule="repetition")
    r = await http.post(CHAT, json=BODY | fields)
    body = await r.json()
    assert r.status == 200, body
    ch = body["choices"][0]
    assert (ch["message"]["content"], ch["finish_reason"], ch["stop_reason"]) == \
        ("bad bad ", "length", "repetition")
    assert len(d0.subs) + len(d1.subs) == 1


async def test_a_stream_that_loops_ends_with_length_and_why(mesh):
    http, d0, d1 = mesh
    d0.script = anomaly(after=2, rule="repetition")
    r = await http.post(CHAT, json=BODY | {"stream": True})
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any("error" in e for e in events)
    last = events[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("length", "repetition")
    assert d1.subs == []


def second_choice_breaks(sub: DecodeSubmit) -> list[TokenChunk]:
    """Choice 1 (request id `<rid>-1`) aborts after two chunks; any other plays good()."""
    return anomaly(after=2)(sub) if sub.request_id.endswith("-1") else good(sub)


async def test_n_choices_stream_never_splices_a_choice_that_showed_content(mesh):
    """n > 1 merges its choices' event streams: a choice's events can be taken from its
    stream before they are written, so `sent` must hold from the moment an event is taken
    (answer.events), or choice 1 would be re-dispatched after "bad bad " went out."""
    http, d0, d1 = mesh
    d0.script = second_choice_breaks
    r = await http.post(CHAT, json=BODY | {"stream": True, "n": 2})
    assert r.status == 200
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    second = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                     if "choices" in e and e["choices"][0]["index"] == 1)
    assert second == "bad bad "
    assert events[-1]["error"]["code"] == "anomaly_detected"
    assert d1.subs == []


async def test_n_choices_whole_answer_redispatches_the_choice_that_broke(mesh):
    http, d0, d1 = mesh
    d0.script = second_choice_breaks
    r = await http.post(CHAT, json=BODY | {"n": 2})
    body = await r.json()
    assert r.status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == ["good good good "] * 2
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert len(d1.subs) == 1 and d1.subs[0].params.seed == d0.subs[1].params.seed
