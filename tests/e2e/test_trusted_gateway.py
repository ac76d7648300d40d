"""The gateway's trust boundary on a real mesh (issue 12): API keys, tenant-isolated
prefix caches on both paths, forged heartbeats, adversarial schemas while streams run.

Real nats-server, real services as processes, real HTTP (aiohttp, and the official openai
and anthropic clients)."""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from collections import defaultdict

import aiohttp
import anthropic
import nats
import openai
import pytest

from pdmesh.local.cluster import Cluster
from shared import micro
from shared.contracts.common import Codec, encode
from shared.contracts.messages import Heartbeat

pytestmark = pytest.mark.timeout(600)

KEYS = ("sk-tenant-a-0123456789abcdef", "sk-tenant-b-fedcba9876543210")
MODEL = "tiny-target"


@pytest.fixture(scope="module")
def mesh(tiny_target, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text("# two tenants\n" + "\n".join(KEYS) + "\n")
    with Cluster(str(tiny_target), prefill=1, decode=1, threads=1, echo=False,
                 # 3000-token streams held until the client leaves: no loop may end one
                 overrides={"decode": {"monitor_repeat_window": 0},
                            "gateway": {"api_key_file": str(key_file),
                                                    "grammar_timeout_s": 1.0}}) as c:
        yield c


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def gateway_stats(mesh) -> dict:
    (st,) = await micro.service_stats(mesh.nats_url, "gateway", wait_s=1.0, expect=1)
    return st


# ---- keys ---------------------------------------------------------------------------------


def http_get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_no_key_wrong_key_valid_key_with_the_official_clients(mesh):
    status, body = http_get(mesh.url + "/v1/models")
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    wrong = openai.OpenAI(base_url=mesh.url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=MODEL, prompt="def f(", max_tokens=2)
    assert info.value.status_code == 401
    ok = openai.OpenAI(base_url=mesh.url + "/v1", api_key=KEYS[0], max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="def f(", max_tokens=2).usage
    a = anthropic.Anthropic(base_url=mesh.url, api_key=KEYS[1], max_retries=0)
    msg = a.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user",
                                                                  "content": "hi"}])
    assert msg.usage.output_tokens >= 1
    bad = anthropic.Anthropic(base_url=mesh.url, api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user",
                                                                  "content": "hi"}])
    assert http_get(mesh.url + "/health")[0] == 200


# ---- tenants ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["pd", "colocated"])
async def test_cached_tokens_never_cross_keys(mesh, path):
    rng = random.Random(path)
    prompt = [rng.randrange(10, 8000) for _ in range(200)]     # 12 whole blocks

    async def cached(http, key, **extra) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "pdmesh_path": path} | extra
        async with http.post(mesh.url + "/v1/completions", json=body, headers=auth(key)) as r:
            data = await r.json()
            assert r.status == 200, data
            assert r.headers["x-pdmesh-path"] == path
            return data["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with aiohttp.ClientSession() as http:
        seen = [await cached(http, KEYS[0]), await cached(http, KEYS[0]),
                await cached(http, KEYS[1]), await cached(http, KEYS[1]),
                await cached(http, KEYS[0], cache_salt="another-namespace"),
                await cached(http, KEYS[1])]
    a1, a2, b1, b2, a_salted, b3 = seen
    assert a1 == 0 and a2 >= 160, seen        # within a key: the prefix is served cached
    assert b1 == 0 and b2 >= 160, seen        # across keys: nothing, in any tier
    assert a_salted == 0 and b3 >= 160, seen  # the request's own cache_salt splits further


# ---- forged heartbeats ------------------------------------------------------------------


async def test_a_forged_bad_heartbeat_during_200_requests(mesh):
    nc = await nats.connect(**mesh.client_options("decode"))   # a decode that lies
    stop = asyncio.Event()
    forged = 0

    async def forge():
        nonlocal forged
        while not stop.is_set():   # "least loaded" by far, with an id no subject can carry
            hb = Heartbeat(service="decode", instance_id="Forged.Decode>*", running=0,
                           capacity=4096, blocks_free=1 << 30)
            await nc.publish("pdmesh.evt.decode.heartbeat", encode(hb))
            forged += 1
            await asyncio.sleep(1.0)

    before = await gateway_stats(mesh)
    task = asyncio.create_task(forge())
    statuses: list[int] = []
    sem = asyncio.Semaphore(8)

    async def one(http, i: int):
        chat = i % 2 == 0
        body = ({"messages": [{"role": "user", "content": f"count to {i}"}]} if chat
                else {"prompt": f"def f{i}(x):"}) | {"model": MODEL, "max_tokens": 4,
                                                      "stream": i % 3 == 0}
        url = mesh.url + ("/v1/chat/completions" if chat else "/v1/completions")
        async with sem, http.post(url, json=body, headers=auth(KEYS[i % 2])) as r:
            text = await r.text()
            statuses.append(r.status)
            assert '"error":' not in text, text      # an error object, not the word in text

    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(one(http, i) for i in range(200)))
    finally:
        stop.set()
        await task
        await nc.close()
    assert statuses.count(200) == 200, sorted(set(statuses))
    after = await gateway_stats(mesh)
    assert after["invalid_heartbeats"] - before["invalid_heartbeats"] >= forged >= 2
    assert after["in_flight"] == 0 and after["queues"] == 0       # nothing leaked
    assert after["failures"] == before["failures"]


# ---- adversarial schemas during streams -------------------------------------------------


def nested(levels: int) -> str:
    """JSON text (deeper than json.dumps recurses)."""
    return ('{"type":"object","properties":{"a":' * levels + '{"type":"string"}'
            + '},"required":["a"]}' * levels)


def adversarial(i: int) -> str:
    """50 schemas: huge enums, deep nesting, long patterns, slow-but-in-budget objects."""
    return json.dumps(_adversarial(i)) if i % 5 != 1 else nested(30 + 10 * i)


def _adversarial(i: int) -> dict:
    kind = i % 5
    if kind == 0:                                       # huge enums
        return {"type": "object", "properties": {"e": {"enum": [
            f"v{i}_{j}_" + "x" * (i % 7) for j in range(2000 + 500 * i)]}}}
    if kind == 2:                                       # long patterns
        pats = ["^.{1,5000}$", "((a|b)(c|d)){1,2000}", "a" * 5000, "(x+x+)+y{1,900}",
                "^(" + "|".join(f"w{j}" for j in range(400)) + ")$"]
        return {"type": "object", "properties": {"p": {"type": "string",
                                                       "pattern": pats[(i // 5) % 5]}}}
    if kind == 3:      # in the budget, 0.7 s or 0.1 s to compile (then decode compiles it)
        heavy = (i // 5) % 2 == 0
        return {"type": "object", "properties": {
            "u": {"anyOf": [{"type": "object", "properties": {
                f"k{i}_{j}_{k}": {"type": "integer"} for k in range(5)}}
                for j in range(100 if heavy else 10)]},
            "o": {"type": "object", "properties": {f"f{i}_{k}": {"type": "string"}
                                                   for k in range(240 if heavy else 60)}}}}
    return {"type": "object", "properties": {"u": {"anyOf": [   # wide unions
        {"type": "object", "properties": {f"k{i}_{j}_{k}": {"type": "integer"}
                                          for k in range(4)}} for j in range(200)]}}}


async def test_adversarial_schemas_during_16_streams(mesh):
    nc = await nats.connect(mesh.nats_url)
    beats: dict[str, list[float]] = defaultdict(list)
    hb_codec = Codec(Heartbeat)

    async def on_beat(msg):
        beats[hb_codec.decode(msg.data).instance_id].append(time.monotonic())
    await nc.subscribe("pdmesh.evt.decode.heartbeat", cb=on_beat)
    started, stop = asyncio.Event(), asyncio.Event()
    streaming = 0
    stream_tokens: list[int] = []

    async def stream(http, i: int):
        nonlocal streaming
        body = {"model": MODEL, "prompt": f"def stream_{i}(n):", "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        n = 0
        async with http.post(mesh.url + "/v1/completions", json=body,
                             headers=auth(KEYS[i % 2])) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:]), line   # no loss, no abort
                    n += 1
                    if n == 1:
                        streaming += 1
                        if streaming == 16:
                            started.set()
                if stop.is_set():
                    break                                  # the client leaves: aborted
        stream_tokens.append(n)

    async def schema(http, i: int) -> int:
        body = ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": '
                '"Answer in JSON."}], "response_format": {"type": "json_schema", "json_schema": '
                '{"name": "s%d", "schema": %s}}}' % (MODEL, i, adversarial(i)))
        async with http.post(mesh.url + "/v1/chat/completions", data=body, headers=auth(
                KEYS[0]) | {"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        streams = [asyncio.create_task(stream(http, i)) for i in range(16)]
        await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        sem = asyncio.Semaphore(4)

        async def limited(i):
            async with sem:
                return await schema(http, i)
        statuses = await asyncio.gather(*(limited(i) for i in range(50)))
        window = (t0, time.monotonic())
        still = sum(1 for t in streams if not t.done())
        stop.set()
        await asyncio.gather(*streams)
    await nc.close()
    gaps = {iid: max(b - a for a, b in zip(ts, ts[1:])) for iid, ts in beats.items()
            if ts and ts[-1] > window[0]}
    deadline = time.monotonic() + 10
    while (st := await gateway_stats(mesh))["queues"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)                        # the aborted streams are released
    print(f"schema statuses {sorted((s, statuses.count(s)) for s in set(statuses))}, storm "
          f"{window[1] - window[0]:.1f}s, max decode heartbeat gap "
          f"{max(gaps.values(), default=-1):.2f}s, stream chunks {sorted(stream_tokens)}, "
          f"gateway grammar { {k: v for k, v in st.items() if k.startswith('grammar_')} }")
    assert set(statuses) <= {200, 400, 429}, statuses   # never a 5xx
    assert statuses.count(400) >= 30, statuses          # refused: budget or time limit
    assert statuses.count(200) >= 2, statuses           # and light ones served by decode
    assert still == 16, "every stream ran through the whole schema storm"
    assert gaps and max(gaps.values()) < 2.0, gaps      # 1 s beats, none over 1 s late
    assert st["decode_instances"] == 1 and st["queues"] == 0
