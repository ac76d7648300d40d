"""Gateway API keys, tenant salts and bounded inputs (issue 12), over real HTTP against a
real nats-server (no decode instance: what is refused is refused before dispatch).
Serving with keys through a real mesh: tests/e2e/test_trusted_gateway.py."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway import auth
from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from services.gateway.dispatch import DecodeClient
from services.gateway.limits import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, check_fits
from services.gateway.protocol import OpenAIError
from services.gateway.registry import Registry
from shared.contracts.common import encode
from shared.contracts.messages import Heartbeat
from shared.contracts.sampling import SamplingParams
from shared.settings import load

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi."}]
KEYS = ("sk-alpha-0123456789", "sk-beta-9876543210")


def cfg_for(model_dir, nats_url, **kw) -> GatewayConfig:
    base = dict(model=str(model_dir), nats_url=nats_url, decode_dead_after_s=1.0,
                submit_timeout_s=1.0, request_timeout_s=20, drain_grace_s=0.3)
    return GatewayConfig(**(base | kw))


@pytest.fixture
async def keyed(nats_url, spec, gateway_model_dir, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# the second tenant\n\n{KEYS[1]}\n")
    cfg = cfg_for(gateway_model_dir, nats_url, api_key=KEYS[0], api_key_file=str(key_file))
    async with TestClient(TestServer(create_app(cfg, spec))) as c:
        yield c


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def openai_error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- keys ---------------------------------------------------------------------------------


def test_keys_from_flags_env_and_file(tmp_path, monkeypatch, gateway_model_dir):
    f = tmp_path / "keys"
    f.write_text("# comment\nk3\n\n  k4  \n")
    assert auth.parse_keys("k1, k2,,", str(f)) == ["k1", "k2", "k3", "k4"]
    with pytest.raises(ValueError, match="cannot|No such"):
        auth.parse_keys("", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        auth.parse_keys("", str(tmp_path / "empty"))
    model = ["--model", str(gateway_model_dir)]
    cfg = load(GatewayConfig, model + ["--api-key", "a", "--api-key", "b,c"])
    assert auth.parse_keys(cfg.api_key, cfg.api_key_file) == ["a", "b", "c"]
    monkeypatch.setenv("PDMESH_API_KEY", "x,y")
    assert load(GatewayConfig, model).api_key == "x,y"
    with pytest.raises(ValueError, match="api_key_file"):
        GatewayConfig(model=str(gateway_model_dir), api_key_file=str(tmp_path / "missing"))


def test_tenants_and_salts():
    ring = auth.KeyRing(list(KEYS))
    a, b = ring.tenant(KEYS[0]), ring.tenant(KEYS[1])
    assert a and b and a != b and KEYS[0] not in a      # a digest, never the key
    assert ring.tenant(KEYS[0]) == a and ring.tenant("sk-alpha-012345678") is None
    assert auth.cache_salt(a, None, shared=False) != auth.cache_salt(b, None, shared=False)
    assert auth.cache_salt(a, None, shared=True) == auth.cache_salt(b, None, shared=True) == ""
    assert auth.cache_salt(a, "x", shared=False) not in ("", auth.cache_salt(a, None, False))
    assert auth.cache_salt(a, "x", shared=True) == auth.cache_salt(b, "x", shared=True) != ""
    assert auth.cache_salt("", None, shared=False) == ""          # open gateway: unsalted
    assert not auth.KeyRing([]).enabled


async def test_no_key_wrong_key_valid_key(keyed):
    e = await openai_error(await keyed.get("/v1/models"), 401)
    assert e["type"] == "invalid_request_error" and e["code"] is None
    assert "API key" in e["message"]
    r = await keyed.get("/v1/models", headers=bearer("sk-wrong-000000000000"))
    e = await openai_error(r, 401)
    assert e["code"] == "invalid_api_key" and "sk-wrong" not in e["message"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await keyed.get("/v1/models", headers=bearer(KEYS[0]))).status == 200
    assert (await keyed.get("/v1/models", headers={"x-api-key": KEYS[1]})).status == 200
    assert (await keyed.get("/v1/models", headers={"Authorization": KEYS[0]})).status == 401
    for path in ("/tokenize", "/detokenize", CHAT, "/v1/completions", "/v1/responses"):
        await openai_error(await keyed.post(path, json={}), 401)
    r = await keyed.post("/tokenize", json={"prompt": "hi"}, headers=bearer(KEYS[1]))
    assert r.status == 200, await r.text()


async def test_anthropic_clients_get_their_error_shape(keyed):
    r = await keyed.post("/v1/messages", json={})
    assert r.status == 401
    assert (await r.json())["error"]["type"] == "authentication_error"
    r = await keyed.post("/v1/messages/count_tokens", headers={"x-api-key": KEYS[0]},
                         json={"model": "x", "messages": MSGS})
    assert r.status != 401


async def test_health_open_metrics_keyed(keyed, nats_url, spec, gateway_model_dir):
    assert (await keyed.get("/health")).status in (200, 503)       # never 401: probes
    assert (await keyed.get("/ready")).status in (200, 503)
    await openai_error(await keyed.get("/metrics"), 401)
    assert (await keyed.get("/metrics", headers=bearer(KEYS[0]))).status == 200
    cfg = cfg_for(gateway_model_dir, nats_url, api_key=KEYS[0], open_metrics=True)
    async with TestClient(TestServer(create_app(cfg, spec))) as c:
        assert (await c.get("/metrics")).status == 200
        await openai_error(await c.get("/v1/models"), 401)


async def test_no_key_configured_is_open(nats_url, spec, gateway_model_dir):
    cfg = cfg_for(gateway_model_dir, nats_url)
    async with TestClient(TestServer(create_app(cfg, spec))) as c:
        assert (await c.get("/v1/models")).status == 200
        assert (await c.get("/metrics")).status == 200
        stats = c.server.app[GATEWAY].stats()
        assert stats["auth"] is False


# ---- bodies -------------------------------------------------------------------------------


async def test_body_limit_is_the_nats_max_payload(keyed):
    gw = keyed.server.app[GATEWAY]
    assert gw.body_limit == gw.runtime.nc.max_payload == 1 << 20   # nats-server's default
    big = b'{"messages": "' + b"x" * (2 << 20) + b'"}'
    e = await openai_error(await keyed.post(CHAT, data=big, headers=bearer(KEYS[0])), 413)
    assert e["code"] == "request_too_large" and str(gw.body_limit) in e["message"]

    async def chunks():                      # no Content-Length: cut off while read
        for _ in range(40):
            yield b"x" * (64 << 10)
    r = await keyed.post(CHAT, data=chunks(), headers=bearer(KEYS[0]))
    await openai_error(r, 413)


async def test_a_submission_over_max_payload_is_413_and_leaves_nothing(nats_url):
    nc = await nats.connect(nats_url)
    try:
        reg = Registry(5.0)
        reg.observe(Heartbeat(service="decode", instance_id="d0"), time.monotonic())
        client = DecodeClient(nc, reg, "gw", "", 1.0, 10.0)
        prompt = [7999] * (nc.max_payload // 5 + 10)
        with pytest.raises(OpenAIError) as info:
            await client.submit("r1", prompt, SamplingParams(), _none())
        assert info.value.status == 413 and info.value.code == "request_too_large"
        assert client.queues == {} and reg.instances["d0"].sent_since_hb == 0
    finally:
        await nc.close()
    with pytest.raises(OpenAIError):
        check_fits(1 << 20, 1 << 20)
    check_fits((1 << 20) - 4096, 1 << 20)


def _none():
    from shared.contracts.constraint import Constraint
    return Constraint()


BAD_BODIES = [
    ({"stop": ["x" * 600]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "s" * 300}, "cache_salt"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": "1e400"}, "repetition_penalty"),   # JSON's 1e400 is inf
    ({"repetition_penalty": 1000.0}, "repetition_penalty"),
    ({"temperature": "-1e400"}, "temperature"),
    ({"top_k": 1 << 40}, "top_k"),
]


@pytest.mark.parametrize("extra,param", BAD_BODIES)
async def test_caps_and_ranges_are_400s(keyed, extra, param):
    body = json.dumps({"messages": MSGS, "max_tokens": 4} | extra)
    body = body.replace('"1e400"', "1e400").replace('"-1e400"', "-1e400")
    r = await keyed.post(CHAT, data=body, headers=bearer(KEYS[0]) | {
        "Content-Type": "application/json"})
    e = await openai_error(r, 400)
    assert e["param"] == param, e


# ---- grammar compile: off the loop, with a time limit ---------------------------------


def slow_schema(objects: int, tag: str) -> dict:
    """Within the static budget, yet 0.15-0.3 s to compile here (240 optional fields,
    and 100 anyOf branches); a small schema compiles in ~1 ms."""
    union = {"anyOf": [{"type": "object", "properties": {f"k{j}_{k}": {"type": "integer"}
                                                         for k in range(5)}}
                       for j in range(100)]}
    return {"type": "object", "properties": {"u": union} | {
        f"{tag}{j}": {"type": "object", "properties": {f"f{i}": {"type": "string"}
                                                       for i in range(240 // objects)}}
        for j in range(objects)}}


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


BUDGET = [
    {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(1001)]}}},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(257)}},
    {"type": "object", "properties": {"u": {"anyOf": [{"type": "integer"}] * 129}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^.{1,5000}$"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "a" * 1001}}},
]


async def test_schemas_over_the_static_budget_are_refused_at_once(keyed):
    """Refused before any compile is tried: the grammar check never sees them (not timed:
    a busy machine once took 0.6 s to answer)."""
    gw, compiled = keyed.server.app[GATEWAY], []
    check = gw.grammar._run

    async def counted(c):
        compiled.append(c)
        return await check(c)
    gw.grammar._run = counted
    for schema in BUDGET:
        r = await keyed.post(CHAT, headers=bearer(KEYS[0]), json={
            "messages": MSGS, "max_tokens": 4, "response_format": fmt(schema)})
        e = await openai_error(r, 400)
        assert e["code"] == "schema_too_complex" and compiled == []
    small = {"type": "object", "properties": {"x": {"type": "integer"}}}
    r = await keyed.post(CHAT, headers=bearer(KEYS[0]), json={
        "messages": MSGS, "max_tokens": 4, "response_format": fmt(small)})
    assert r.status == 503 and len(compiled) == 1     # a small one is compiled (no decode)
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"x": {"enum": list(range(300))}}}}} for i in range(4)]
    r = await keyed.post(CHAT, headers=bearer(KEYS[0]), json={
        "messages": MSGS, "max_tokens": 4, "tools": tools})     # 1200 values together
    e = await openai_error(r, 400)
    assert e["code"] == "schema_too_complex" and e["param"] == "tools[3].function.parameters"


async def test_a_schema_that_compiles_too_slowly_is_refused(nats_url, spec, gateway_model_dir,
                                                            monkeypatch):
    """Refused when the compile outlasts grammar_timeout_s, without waiting for it: the answer
    comes while the compile still runs, on a worker thread (not the event loop); the verdict is
    remembered, so the schema is never compiled again. Shown by order and count, not by time
    bounds (a busy machine once took 0.6 s for an instant answer)."""
    from services.gateway import grammar_check
    compiles = []                      # the thread each compile ran on, once it finished
    problem_of = grammar_check.grammar_problem

    def traced(constraint, compile_fn):
        try:
            return problem_of(constraint, compile_fn)
        finally:
            compiles.append(threading.current_thread().name)
    monkeypatch.setattr(grammar_check, "grammar_problem", traced)
    cfg = cfg_for(gateway_model_dir, nats_url, grammar_timeout_s=0.05)   # 3x below the slow one
    async with TestClient(TestServer(create_app(cfg, spec))) as c:
        gw = c.server.app[GATEWAY]
        await gw.grammar.warm()
        body = {"messages": MSGS, "max_tokens": 4, "response_format": fmt(slow_schema(1, "t"))}
        e = await openai_error(await c.post(CHAT, json=body), 400)
        assert e["code"] == "schema_too_complex" and "too complex" in e["message"]
        assert e["param"] == "response_format.json_schema.schema"
        assert compiles == []                # answered before the compile finished
        for _ in range(600):
            if compiles:
                break
            await asyncio.sleep(0.05)
        assert len(compiles) == 1 and compiles[0].startswith("gateway-grammar")
        e = await openai_error(await c.post(CHAT, json=body), 400)   # remembered (by digest)
        assert e["code"] == "schema_too_complex" and len(compiles) == 1
        assert gw.stats()["grammar_too_complex"] == 1
        ok = {"messages": MSGS, "max_tokens": 4, "response_format": {"type": "json_schema",
              "json_schema": {"schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}
        r = await c.post(CHAT, json=ok)      # compiles in time: on to dispatch (no decode)
        assert r.status == 503, await r.text()


# ---- heartbeats ---------------------------------------------------------------------------


def test_the_registry_ignores_heartbeats_it_cannot_believe(caplog):
    reg = Registry(5.0)
    now = time.monotonic()
    bad = [Heartbeat(service="decode", instance_id=i) for i in
           ("D0", "a.b", "a>b", "", "x" * 200, "d-0", "d 0", "*")]
    bad += [Heartbeat(service="decode", instance_id="d1", running=-1),
            Heartbeat(service="decode", instance_id="d1", capacity=1 << 40)]
    with caplog.at_level(logging.WARNING, "pdmesh.gateway"):
        for _ in range(3):
            for hb in bad:
                reg.observe(hb, now)
    assert reg.instances == {} and reg.invalid == 3 * len(bad)
    assert reg.choose(now) is None
    logged = [r for r in caplog.records if "ignoring decode heartbeats" in r.getMessage()]
    assert len(logged) == len(bad) - 1          # once per id ("d1" twice: logged once)
    reg.observe(Heartbeat(service="decode", instance_id="decode_0_ab12"), now)
    assert reg.choose(now) == "decode_0_ab12"


async def test_forged_bad_heartbeats_never_reach_dispatch(keyed, nats_url):
    gw = keyed.server.app[GATEWAY]
    nc = await nats.connect(nats_url)
    try:
        for _ in range(3):
            await nc.publish("pdmesh.evt.decode.heartbeat", encode(Heartbeat(
                service="decode", instance_id="Evil.Instance", running=0, capacity=64)))
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await nc.close()
    assert gw.registry.invalid >= 3 and not gw.registry.instances
    r = await keyed.post(CHAT, json={"messages": MSGS, "max_tokens": 4},
                         headers=bearer(KEYS[0]))
    e = await openai_error(r, 503)                 # no instance: not a 500
    assert e["code"] == "no_decode_instance"
    assert gw.client.queues == {}


async def test_errors_carry_no_paths_or_reprs(keyed):
    r = await keyed.post(CHAT, data=b"{not json", headers=bearer(KEYS[0]))
    e = await openai_error(r, 400)
    assert "Traceback" not in e["message"] and "/work" not in e["message"]


# ---- client input that once reached the catch-all (a 500): each is a 4xx now ----------------


async def test_a_body_whose_content_encoding_does_not_decode_is_400(keyed):
    for path, encoding in ((CHAT, "gzip"), ("/tokenize", "deflate"), ("/v1/messages", "gzip")):
        r = await keyed.post(path, data=b"this is not gzip", headers=bearer(KEYS[0]) | {
            "Content-Encoding": encoding, "Content-Type": "application/json"})
        assert r.status == 400 and r.headers["Connection"] == "close", await r.text()
        body = await r.json()
        err = body["error"]
        assert "could not be read" in err["message"] and encoding in err["message"], err
        if path != "/v1/messages":                     # (there: Anthropic's shape)
            assert err["code"] == "invalid_body", err


async def test_an_api_key_header_that_is_not_utf8_is_401(keyed):
    async def raw(header: bytes) -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection(keyed.host, keyed.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header +
                     b"\r\n\r\n")
        data = await reader.read()
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)
    for header in (b"Authorization: Bearer \xff\xfe",      # (the 401 shows the 2nd key's ends)
                   b"x-api-key: \xffsk-\xc3\xa9t\xe9-0123456789\xfe"):
        status, body = await raw(header)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body


ODD_SCHEMAS = [   # required items that are not names; a counted repeat of 4,400 digits
    {"type": "object", "properties": {"a": {}}, "required": [["a"], {"b": 1}]},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{" + "9" * 4400 + "}"}}},
]


@pytest.mark.parametrize("schema", ODD_SCHEMAS, ids=["required-unhashable", "repeat-4400-digits"])
async def test_odd_schemas_are_400s_on_every_api(keyed, schema):
    tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for path, body in (
            (CHAT, {"messages": MSGS, "tools": tool}),
            (CHAT, {"messages": MSGS, "response_format": fmt(schema)}),
            ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f",
                                                         "parameters": schema}]}),
            ("/v1/messages", {"model": "tiny-target", "max_tokens": 4, "messages": MSGS,
                              "tools": [{"name": "f", "input_schema": schema}]}),
            ("/tokenize", {"messages": MSGS, "tools": tool})):
        r = await keyed.post(path, json=body, headers=bearer(KEYS[0]))
        # /tokenize compiles no grammar: it may count the tokens of a schema xgrammar refuses
        assert r.status == 400 or path == "/tokenize" and r.status == 200, (path, await r.text())


def test_cache_aware_routing_is_per_tenant():
    """The gateway's routing hint never says where another tenant's prompt went."""
    from services.gateway.affinity import PrefixAffinity
    aff = PrefixAffinity(granularity=16)
    prompt = list(range(100, 300))
    aff.record(prompt, "decode_a", "salt-a")
    assert aff.best(prompt, "salt-a") == {"decode_a": 192}
    assert aff.best(prompt, "salt-b") == {} and aff.best(prompt) == {}
