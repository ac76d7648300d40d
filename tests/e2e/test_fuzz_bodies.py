"""Bounded inputs on a real mesh (issue 12): a hypothesis fuzzer sends over 1,000 bodies
to /v1/chat/completions and /v1/completions, covering every sampling field, tools,
response_format and messages, valid and not: no response is a 5xx and the mesh is
healthy after. Then 600 distinct ~30 MiB schema bodies are all refused while the
gateway's memory stays flat.

Real nats-server, real services as processes, real HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdmesh.cluster import Cluster
from shared import micro

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-target"
BATCH = 8                       # bodies per hypothesis example, sent concurrently
EXAMPLES = 130                  # 130 x 8 = 1,040 bodies
SENT: list[tuple[str, int]] = []


@pytest.fixture(scope="module")
def mesh(tiny_target):
    with Cluster(str(tiny_target), prefill=1, decode=1, threads=1, echo=False,
                 log_dir=os.environ.get("PDMESH_TEST_LOG_DIR"),
                 overrides={"gateway": {"default_max_tokens": 8, "grammar_timeout_s": 2.0}}
                 ) as c:
        yield c


# ---- strategies ----------------------------------------------------------------------------

junk = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                 st.lists(st.integers(-5, 9000), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def ok_or_junk(ok):
    return st.one_of(ok, ok, ok, junk)


unit = st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0, 1e-9, -0.5, 1.5]))
small_float = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1e-6, 2.0, -2.0, 1e300, -1e300]))
max_tokens = st.one_of(st.integers(-2, 8), st.sampled_from([4096, 10 ** 9, 2 ** 63, -(2 ** 63)]))
token_id = st.one_of(st.integers(0, 8191), st.sampled_from([-1, 8192, 2 ** 40]))
text = st.text(max_size=80)

leaf_schema = st.sampled_from([
    {"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number"},
    {"type": "boolean"}, {"type": "null"}, {"enum": ["a", "b", 3]}, {"const": "x"},
    {"type": "string", "pattern": "^[a-z]{1,5}$"}, {"type": "string", "format": "date"},
    {"type": "string", "maxLength": 3}, {}, {"type": "array", "items": {"type": "integer"}},
    {"type": "object"}, {"type": "object", "additionalProperties": False},
    {"not": {"type": "string"}}, {"$ref": "#/$defs/x"}, {"type": "wat"}, {"uniqueItems": True}])
schema = st.recursive(leaf_schema, lambda kids: st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        st.from_regex(r"[a-z_]{1,6}", fullmatch=True), kids, max_size=3)},
        optional={"required": st.lists(st.from_regex(r"[a-z_]{1,6}", fullmatch=True),
                                       max_size=2)}),
    st.fixed_dictionaries({"type": st.just("array"), "items": kids},
                          optional={"minItems": st.integers(0, 3)}),
    st.fixed_dictionaries({"anyOf": st.lists(kids, min_size=1, max_size=3)})), max_leaves=6)

tool = st.fixed_dictionaries({
    "type": ok_or_junk(st.just("function")),
    "function": st.fixed_dictionaries(
        {"name": st.one_of(st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True), text)},
        optional={"description": text, "parameters": st.one_of(schema, junk),
                  "strict": st.booleans()})})
tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}), junk)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "bogus"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {}, optional={"name": text, "schema": st.one_of(schema, junk), "strict": st.booleans()})}),
    junk)
call = st.fixed_dictionaries({
    "type": ok_or_junk(st.just("function")),
    "function": st.fixed_dictionaries({"name": text, "arguments": st.one_of(
        text, st.just('{"a": 1}'), st.dictionaries(st.text(max_size=3), st.integers()))})},
    optional={"id": text})
message = st.fixed_dictionaries(
    {"role": ok_or_junk(st.sampled_from(["system", "developer", "user", "assistant", "tool",
                                          "bogus"]))},
    optional={"content": st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": text}), max_size=2),
        junk),
        "name": text, "tool_calls": st.lists(call, max_size=2), "tool_call_id": text})

# every field: a wild value (out of range, wrong type, junk) ...
WILD = {
    "model": st.sampled_from([MODEL, "nope", ""]), "max_tokens": max_tokens,
    "temperature": small_float, "top_p": unit, "n": st.sampled_from([1, 2, 0, -1]),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(text, st.lists(text, max_size=5), st.just(["x" * 600])),
    "seed": st.integers(-(2 ** 65), 2 ** 65),
    "presence_penalty": small_float, "frequency_penalty": small_float,
    "logit_bias": st.dictionaries(st.one_of(token_id.map(str), text), small_float, max_size=4),
    "user": text, "top_k": st.integers(-2, 2 ** 40), "min_p": unit,
    "repetition_penalty": small_float, "min_tokens": st.integers(-1, 9),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(token_id, max_size=70),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(), "pdmesh_path": st.sampled_from(["pd", "elsewhere"]),
    "cache_salt": st.text(max_size=300), "max_completion_tokens": max_tokens,
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25), "tools": st.lists(tool, max_size=3),
    "tool_choice": tool_choice, "parallel_tool_calls": st.booleans(),
    "response_format": response_format, "functions": st.lists(junk, max_size=1),
    "function_call": junk, "echo": st.booleans(), "suffix": text,
    "best_of": st.sampled_from([1, 2]), "messages": st.lists(message, max_size=4),
    "prompt": st.one_of(text, st.lists(token_id, max_size=40), st.lists(text, max_size=2),
                        st.lists(st.lists(token_id, max_size=5), max_size=2))}
WILD = {k: st.one_of(v, v, junk) for k, v in WILD.items()}

# ... and a valid one
ok_text = st.text(min_size=1, max_size=60)
ok_schema = st.recursive(st.sampled_from([
    {"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number"},
    {"type": "boolean"}, {"enum": ["a", "b", 3]}, {"type": "string", "maxLength": 3}]),
    lambda kids: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        st.from_regex(r"[a-z_]{1,6}", fullmatch=True), kids, min_size=1, max_size=3)}),
    max_leaves=5)
ok_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                           st.fixed_dictionaries({
                                               "name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                                               "parameters": ok_schema.filter(
                                                   lambda x: x.get("type") == "object")})}),
                    min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])
VALID = {
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]), "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1),
    "seed": st.integers(0, 2 ** 63 - 1), "stop": st.lists(ok_text, max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 8191), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, 8191).map(str), st.floats(-100, 100),
                                  max_size=5),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "return_token_ids": st.booleans(),
    "pdmesh_path": st.sampled_from(["pd", "colocated"]), "stream": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=16), "user": ok_text, "n": st.just(1),
    "model": st.just(MODEL)}
ok_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "user"]),
                                    "content": ok_text})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(ok_message, min_size=1, max_size=3)},
    optional=VALID | {"logprobs": st.booleans(), "response_format": st.one_of(
        st.just({"type": "json_object"}), ok_schema.map(lambda x: {
            "type": "json_schema", "json_schema": {"name": "s", "schema": x}}))}
).flatmap(lambda b: st.just(b) if "response_format" in b else st.one_of(
    st.just(b), ok_tools.map(lambda t: b | {"tools": t, "tool_choice": "auto"})))
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(ok_text, st.lists(st.integers(0, 8191), min_size=1, max_size=40))},
    optional=VALID | {"logprobs": st.integers(0, 5)})


def mutated(valid):
    """A valid body with one or two fields made wild (or a required one dropped)."""
    def one(body):
        return st.sampled_from(sorted(WILD)).flatmap(
            lambda k: st.one_of(WILD[k].map(lambda v: body | {k: v}),
                                st.just({x: y for x, y in body.items() if x != k})))
    return st.one_of(valid.flatmap(one), valid.flatmap(one).flatmap(one))


chat_body = st.one_of(valid_chat, mutated(valid_chat))
completion_body = st.one_of(valid_completion, mutated(valid_completion))
bodies = st.lists(st.one_of(chat_body.map(lambda b: ("/v1/chat/completions", b)),
                            completion_body.map(lambda b: ("/v1/completions", b))),
                  min_size=BATCH, max_size=BATCH)


# ---- the fuzzer -----------------------------------------------------------------------------


async def _send(http, url: str, route: str, body: dict) -> tuple[int, str]:
    data = json.dumps(body)
    async with http.post(url + route, data=data, headers={"Content-Type": "application/json"}
                         ) as r:
        return r.status, await r.text()


def _problem(status: int, text: str) -> str | None:
    if status >= 500:
        return f"HTTP {status}: {text[:300]}"
    for line in text.splitlines():           # a stream that failed after its headers
        if line.startswith("data: {") and '"error"' in line:
            err = json.loads(line[6:]).get("error")
            if isinstance(err, dict) and err.get("type") == "server_error":
                return f"stream error: {line[:300]}"
    return None


@settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=bodies)
def test_fuzz_chat_and_completions_bodies(mesh, batch):
    async def run():
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            return await asyncio.gather(*(_send(http, mesh.url, route, body)
                                          for route, body in batch))
    results = asyncio.run(run())
    for (route, body), (status, text) in zip(batch, results):
        SENT.append((route, status))
        problem = _problem(status, text)
        assert problem is None, f"{route} {json.dumps(body)[:2000]} -> {problem}"


def test_the_fuzzer_sent_enough_and_the_mesh_is_healthy(mesh):
    statuses = [s for _, s in SENT]
    print(f"fuzzer: {len(SENT)} bodies, statuses "
          f"{sorted((s, statuses.count(s)) for s in set(statuses))}")
    assert len(SENT) >= 1000 and max(statuses) < 500
    assert statuses.count(200) >= 100            # plenty of it was served, not just refused

    async def check():
        async with aiohttp.ClientSession() as http:
            async with http.get(mesh.url + "/health") as r:
                assert r.status == 200, await r.text()
            body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
            status, _ = await _send(http, mesh.url, "/v1/completions", body)
            assert status == 200
        deadline = time.monotonic() + 20
        while True:
            gw = (await micro.service_stats(mesh.nats_url, "gateway", 1.0, 1))[0]
            dec = (await micro.service_stats(mesh.nats_url, "decode", 1.0, 1))[0]
            if gw["in_flight"] == gw["queues"] == dec["requests"] == 0:
                return
            assert time.monotonic() < deadline, (gw, dec)
            await asyncio.sleep(0.5)
    asyncio.run(check())
    assert mesh.unexpected_exits() == []


# ---- huge bodies ---------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _post_raw(host: str, port: int, body_head: bytes, filler: memoryview, total: int,
                    send_all: bool, chunked: bool = False) -> int:
    """POST a body of `total` bytes (head + filler, repeated); the status line. With
    send_all False the client stops sending once the answer came (it came before the body:
    the gateway refused it from its Content-Length)."""
    reader, writer = await asyncio.open_connection(host, port)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\n{length}\r\n\r\n".encode())
    sent = 0

    async def body():
        nonlocal sent
        for part in (body_head, filler):
            left = total - sent
            piece = part[:left]
            while piece:
                if chunked:
                    writer.write(b"%x\r\n" % len(piece[:1 << 20]) + piece[:1 << 20] + b"\r\n")
                else:
                    writer.write(piece[:1 << 20])
                sent += len(piece[:1 << 20])
                piece = piece[1 << 20:]
                await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
    sender = asyncio.create_task(body())
    try:
        status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
        if send_all:
            await sender
    finally:
        sender.cancel()
        writer.transport.abort()
    return status


@pytest.mark.slow
def test_600_distinct_30mib_schema_bodies_are_refused_in_flat_memory(mesh):
    pid = mesh.procs["gateway-0"].popen.pid
    host, port = mesh.url.split("//")[1].split(":")
    total = 30 << 20
    head = (b'{"model": "tiny-target", "messages": [{"role": "user", "content": "hi"}], '
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "big", '
            b'"schema": {"type": "object", "properties": {"e": {"enum": [')
    filler = memoryview(b'"%08d-value-of-a-huge-enum", ' % 7 * ((total // 28) + 1))

    async def run():
        before = peak = _rss_mib(pid)
        statuses = []
        t0 = time.monotonic()
        for i in range(600):
            distinct = head + b'"body-%06d", ' % i
            statuses.append(await _post_raw(host, int(port), distinct, filler, total,
                                            send_all=i % 50 == 0, chunked=i % 50 == 25))
            peak = max(peak, _rss_mib(pid))
        return before, peak, _rss_mib(pid), statuses, time.monotonic() - t0
    before, peak, after, statuses, took = asyncio.run(run())
    print(f"600 x 30 MiB bodies in {took:.1f}s: statuses {set(statuses)}, gateway RSS "
          f"{before:.0f} -> {after:.0f} MiB (peak {peak:.0f})")
    assert statuses == [413] * 600
    assert peak - before < 200, (before, peak)


@pytest.mark.slow
def test_schemas_under_the_body_limit_are_refused_by_size_without_caching_them(mesh):
    """20 distinct ~7 MiB schemas (under the 8 MiB body limit) are parsed and refused as
    too large before any cache; memory stays flat."""
    pid = mesh.procs["gateway-0"].popen.pid
    before = _rss_mib(pid)

    async def run():
        out = []
        async with aiohttp.ClientSession() as http:
            for i in range(20):
                enum = [f"{i:04d}-{j:07d}-" + "v" * 40 for j in range(120_000)]
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema", "json_schema": {
                            "schema": {"type": "object", "properties": {"e": {"enum": enum}}}}}}
                out.append(await _send(http, mesh.url, "/v1/chat/completions", body))
        return out
    results = asyncio.run(run())
    after = _rss_mib(pid)
    print(f"20 x ~7 MiB schemas: {[s for s, _ in results][:3]}..., RSS {before:.0f} -> "
          f"{after:.0f} MiB")
    for status, text in results:
        assert status == 400 and json.loads(text)["error"]["code"] in (
            "schema_too_large", "schema_too_complex"), text[:300]
    assert after - before < 200
    assert os.path.exists(f"/proc/{pid}")
