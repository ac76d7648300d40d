"""The gateway over HTTP against a real nats-server, with no decode instance: HTTP error
paths, 503 naming why, /health, /metrics, nats.micro registration. Serving through real
decode instances is tested in tests/e2e."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig

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
    reply = await nc.request("$SRV.INFO.gateway", b"", timeout=10)
    assert json.loads(reply.data)["metadata"]["instance_id"] == gw(client).cfg.instance_id


async def test_a_client_gone_while_headers_are_written_is_not_a_server_error(
        nats_url, spec, gateway_model_dir, caplog):
    """A streaming client that leaves before its headers are written makes aiohttp raise
    a ConnectionError from resp.prepare(): that is the client's doing, counted as 499,
    and never an "Error handling request" traceback in the gateway's log (chaos runs
    logged one every few seconds)."""
    import logging

    from aiohttp.client_exceptions import ClientConnectionResetError

    async def headers_fail(request):
        raise ClientConnectionResetError("Cannot write to closing transport")

    cfg = GatewayConfig(model=str(gateway_model_dir), nats_url=nats_url)
    app = create_app(cfg, spec)
    app.router.add_get("/test-only/headers-fail", headers_fail)
    caplog.set_level(logging.ERROR)
    async with TestClient(TestServer(app)) as c:
        resp = await c.get("/test-only/headers-fail")
        assert (await error_of(resp, 499))["code"] == "client_gone"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_scrape_asks_nobody_on_nats(client, monkeypatch):
    """/metrics answers from what the gateway already holds: kvstore's and the prefill
    ranks' STATS are asked in the background (scrape.MeshStats), never on the scrape path,
    whose answer would otherwise wait up to half a second on every scrape."""
    from shared import micro
    g = gw(client)
    await until(lambda: g.mesh_stats.refreshed >= 1)  # (it then sleeps its 2 s)
    g.mesh_stats.every_s = 3600                      # after the next refresh, none for an hour
    await until(lambda: g.mesh_stats.refreshed >= 2, timeout=10)
    asked = []

    async def counting(*a, **kw):
        asked.append(a)
        return []
    monkeypatch.setattr(micro, "stats", counting)
    monkeypatch.setattr(micro, "service_stats", counting)
    for _ in range(3):
        assert (await client.get("/metrics")).status == 200
    assert asked == []
    await g.mesh_stats.refresh()                     # the background refresh does ask
    assert len(asked) == 3                           # kvstore, decode, prefill
