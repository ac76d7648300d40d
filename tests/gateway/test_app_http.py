"""The gateway over HTTP against a real nats-server: error paths without any decode
instance, and the decode protocol against a scripted fake decode (tests/gateway/fake_decode.py):
least-loaded choice, refusals, streaming, disconnects, dead instances, drain."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from shared.contracts.common import ErrorCode
from shared.contracts.messages import Path

from .fake_decode import WORDS, FakeDecode

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
async def client(nats_url, spec, gateway_model_dir):
    cfg = GatewayConfig(model=str(gateway_model_dir), nats_url=nats_url, decode_dead_after_s=1.0,
                        submit_timeout_s=1.0, request_timeout_s=20, drain_grace_s=0.3,
                        max_body_bytes=64 << 10)
    async with TestClient(TestServer(create_app(cfg, spec))) as c:
        yield c


def gw(client):
    return client.server.app[GATEWAY]


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def seen(client, *fakes):
    ids = {f.iid for f in fakes}
    registry = gw(client).registry
    await until(lambda: ids <= {i.hb.instance_id for i in registry.alive(time.monotonic())})


async def error_of(resp, status):
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def sse_events(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- without decode ----------------------------------------------------------------------


async def test_models_list_and_card(client, spec):
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == spec.name and card["owned_by"] == "pdmesh"
    assert card["max_model_len"] == spec.max_model_len
    assert (await (await client.get(f"/v1/models/{spec.name}")).json())["id"] == spec.name
    e = await error_of(await client.get("/v1/models/nope"), 404)
    assert e["code"] == "model_not_found"


async def test_http_error_paths_are_openai_errors(client):
    e = await error_of(await client.post(CHAT, data=b"{oops"), 400)
    assert "JSON" in e["message"]
    e = await error_of(await client.post(CHAT, json={"messages": MSGS, "temperature": "hot"}), 400)
    assert e["param"] == "temperature"
    e = await error_of(await client.post(CHAT, json={"model": "gpt-x", "messages": MSGS}), 404)
    assert e["code"] == "model_not_found"
    e = await error_of(await client.post("/v1/completions", json={"prompt": ["a", "b"]}), 400)
    assert "batch" in e["message"]
    await error_of(await client.get("/v1/nothing"), 404)
    e = await error_of(await client.get(CHAT), 405)
    assert "POST" in e["message"]
    e = await error_of(await client.post(CHAT, data=b"x" * (70 << 10)), 413)
    assert str(64 << 10) in e["message"]


async def test_no_decode_alive_is_503_and_health_says_why(client):
    e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 503)
    assert "no decode instance" in e["message"] and e["type"] == "server_error"
    resp = await client.get("/health")
    assert resp.status == 503
    body = await resp.json()
    assert body["nats_connected"] is True and body["decode_instances"] == 0
    assert "no decode instance" in body["reason"]


async def test_metrics_exposition(client):
    await client.post(CHAT, json={"messages": MSGS})          # 503: no decode
    await client.post(CHAT, data=b"{")                        # 400
    resp = await client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await resp.text()
    assert 'pdmesh_requests_total{path="/v1/chat/completions",status="503"} 1' in text
    assert 'pdmesh_requests_total{path="/v1/chat/completions",status="400"} 1' in text
    assert "# TYPE pdmesh_time_to_first_token_seconds histogram" in text
    assert 'pdmesh_inter_token_latency_seconds_bucket{le="+Inf"} 0' in text
    for gauge in ("pdmesh_requests_in_flight", "pdmesh_prefill_queue_depth",
                  "pdmesh_kv_blocks_used"):
        assert f"# TYPE {gauge} gauge" in text


async def test_registered_with_nats_micro(client):
    nc = gw(client).runtime.nc
    reply = await nc.request("$SRV.INFO.gateway", b"", timeout=2)
    assert json.loads(reply.data)["metadata"]["instance_id"] == gw(client).cfg.instance_id


# ---- with a fake decode ------------------------------------------------------------------


async def test_chat_goes_to_least_loaded_and_aggregates(client, nats_url, spec):
    async with FakeDecode(nats_url, running=5) as busy, \
            FakeDecode(nats_url, running=0, path=Path.PD) as idle:
        await seen(client, busy, idle)
        assert (await client.get("/health")).status == 200
        resp = await client.post(CHAT, json={"model": spec.name, "messages": MSGS,
                                             "max_tokens": 8})
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-pdmesh-path"] == "pd"
        body = await resp.json()
        assert not busy.submits and len(idle.submits) == 1
        sub = idle.submits[0]
        assert sub.params.seed is not None and 0 <= sub.params.seed < 1 << 63   # resolved here
        assert sub.params.max_tokens == 8
        assert sub.tokenizer_fingerprint == spec.tokenizer.fingerprint
        assert body["object"] == "chat.completion" and body["model"] == spec.name
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": "".join(WORDS),
                                     "refusal": None}
        assert choice["finish_reason"] == "stop"
        n = len(sub.prompt_ids)
        assert body["usage"] == {"prompt_tokens": n, "completion_tokens": len(WORDS),
                                 "total_tokens": n + len(WORDS)}
        assert not idle.aborts     # finished requests are not aborted


async def test_client_seed_is_kept(client, nats_url):
    async with FakeDecode(nats_url) as d:
        await seen(client, d)
        await client.post("/v1/completions", json={"prompt": "x", "seed": 1234})
        assert d.submits[0].params.seed == 1234


async def test_overloaded_instance_is_skipped(client, nats_url):
    async with FakeDecode(nats_url, running=0, refuse=ErrorCode.OVERLOADED) as full, \
            FakeDecode(nats_url, running=3) as other:
        await seen(client, full, other)
        resp = await client.post(CHAT, json={"messages": MSGS})
        assert resp.status == 200, await resp.text()
        assert len(full.submits) == 1 and len(other.submits) == 1
        assert other.submits[0].request_id != full.submits[0].request_id


async def test_all_refusing_is_503_naming_them(client, nats_url):
    async with FakeDecode(nats_url, refuse=ErrorCode.OVERLOADED) as d:
        await seen(client, d)
        e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 503)
        assert d.iid in e["message"] and "overloaded" in e["message"]


async def test_decode_invalid_request_is_400(client, nats_url):
    async with FakeDecode(nats_url, refuse=ErrorCode.INVALID_REQUEST) as d:
        await seen(client, d)
        e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 400)
        assert "fake refuses" in e["message"]


async def test_stream_with_usage_through_openai_client(client, nats_url, spec):
    async with FakeDecode(nats_url) as d:
        await seen(client, d)
        oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        stream = await oai.chat.completions.create(
            model=spec.name, messages=MSGS, stream=True, stream_options={"include_usage": True},
            logprobs=True, top_logprobs=1)
        chunks = [c async for c in stream]
        await oai.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["stop"]
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(lps) == len(WORDS) and lps[0].content[0].top_logprobs[0].logprob == -0.5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(WORDS)


async def test_completions_stream_and_logprobs(client, nats_url):
    async with FakeDecode(nats_url, finish_reason="length") as d:
        await seen(client, d)
        resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        assert all(e["object"] == "text_completion" for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "".join(WORDS)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 1})
        body = await resp.json()
        lp = body["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [-0.5] * len(WORDS) and len(lp["top_logprobs"]) == len(WORDS)


async def test_error_chunk_becomes_sse_error_event_and_json_error(client, nats_url):
    async with FakeDecode(nats_url, mode="error") as d:
        await seen(client, d)
        resp = await client.post(CHAT, json={"messages": MSGS, "stream": True})
        assert resp.status == 200
        events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        assert "prefill worker died" in events[-2]["error"]["message"]
        e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 503)
        assert e["code"] == "prefill_failed"


async def test_dead_instance_fails_request_within_seconds(client, nats_url):
    async with FakeDecode(nats_url, mode="stall") as d:
        await seen(client, d)
        t0 = time.monotonic()
        task = asyncio.create_task(client.post(CHAT, json={"messages": MSGS}))
        await until(lambda: d.submits)
        d.stop_heartbeats()
        e = await error_of(await task, 503)
        assert e["code"] == "instance_lost" and d.iid in e["message"]
        assert time.monotonic() - t0 < 5


async def test_dead_instance_mid_stream_gets_error_event(client, nats_url):
    async with FakeDecode(nats_url, mode="stall") as d:
        await seen(client, d)
        resp = await client.post(CHAT, json={"messages": MSGS, "stream": True})
        d.stop_heartbeats()
        events = sse_events(await resp.text())
        assert events[-2]["error"]["code"] == "instance_lost" and events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_at_decode(client, nats_url, stream):
    async with FakeDecode(nats_url, mode="slow") as d:
        await seen(client, d)
        url = client.make_url(CHAT)
        async with aiohttp.ClientSession() as s:
            if stream:
                async with s.post(url, json={"messages": MSGS, "stream": True}) as resp:
                    await resp.content.readline()
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(url, json={"messages": MSGS},
                                 timeout=aiohttp.ClientTimeout(total=0.5))
        await until(lambda: d.aborts)
        assert d.aborts[0].reason == "client"
        assert d.aborts[0].request_id == d.submits[0].request_id
        await until(lambda: gw(client).in_flight == 0)


async def test_drain_refuses_new_and_ends_in_flight_with_explicit_error(client, nats_url):
    async with FakeDecode(nats_url, mode="stall") as d:
        await seen(client, d)
        task = asyncio.create_task(client.post(CHAT, json={"messages": MSGS}))
        await until(lambda: d.submits)
        await gw(client).drain()          # grace 0.3 s, then the in-flight one is ended
        e = await error_of(await task, 503)
        assert "shutting down" in e["message"]
        await until(lambda: d.aborts)
        e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 503)
        assert e["code"] == "shutting_down"
        assert (await client.get("/health")).status == 503


async def test_request_timeout_is_504_and_aborts(client, nats_url):
    async with FakeDecode(nats_url, mode="stall") as d:
        await seen(client, d)
        gw(client).client.request_timeout_s = 0.6
        e = await error_of(await client.post(CHAT, json={"messages": MSGS}), 504)
        assert e["code"] == "timeout" and "0.6" in e["message"]
        await until(lambda: d.aborts)
        assert d.aborts[0].reason == "timeout"
