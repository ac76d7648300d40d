"""Tool calling and structured output over HTTP, through the whole mesh: the official openai
client gets well-formed tool_calls (required, named; stream and not) whose arguments
validate against the tool's schema, a multi-turn exchange with tool results works,
json_schema output validates, and a fuzzed set of tool / response_format bodies never gets
a 5xx."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import jsonschema
import openai
import pytest

from tests.gateway.tool_bodies import fn, named, random_body

MODEL = "tiny-target"
USER = [{"role": "user", "content": "What is the weather in Paris? Set an alarm too."}]
# bounded schemas (maxLength, enums, integer ranges, maxItems): a greedy tiny model cannot
# wander forever inside a string or a number, so every call ends well within max_tokens
WEATHER = fn("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}, description="Current weather in a city.")
ALARM = fn("set_alarm", {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
    "label": {"type": "string", "maxLength": 8}},
    "required": ["hour", "minute"]})
ORDER = fn("place_order", {"type": "object", "properties": {
    "item": {"type": "string", "enum": ["tea", "cake", "soup"]},
    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
    "address": {"type": "object", "properties": {
        "zip": {"type": "string", "maxLength": 6},
        "floor": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["zip"]},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["item", "qty", "address"]})
PING = fn("ping")
TOOLS = [WEATHER, ALARM, ORDER, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
           for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "kind": {"type": "string", "enum": ["a", "b"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "kind"], "additionalProperties": False}
MAX = 160


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def check_calls(calls, only: str | None = None, single: bool = False) -> list[tuple[str, dict]]:
    assert calls, "no tool calls"
    if single:
        assert len(calls) == 1, calls
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and len(c.id) == 29, c
        assert c.function.name in SCHEMAS, c
        if only:
            assert c.function.name == only
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


def create(client, **kw):
    return client.chat.completions.create(**({"model": MODEL, "messages": USER, "tools": TOOLS,
                                               "max_tokens": MAX, "temperature": 0} | kw))


def streamed(client, **kw):
    """(tool calls accumulated from deltas as (id, name, arguments), content, finish)."""
    calls: dict[int, dict] = {}
    content, finish = "", []
    for chunk in create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert c["id"] is None, "id sent twice"
                c["id"] = tc.id
                assert tc.type == "function"
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        if ch.finish_reason:
            finish.append(ch.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], content, finish


CHOICES = [("required", None), (named("set_alarm"), "set_alarm"),
           (named("place_order"), "place_order"), (named("ping"), "ping")]


IDS = ["required", "alarm", "order", "ping"]
_whole: dict[str, list] = {}     # non-stream answers, compared with the streamed ones


def forced(client, choice) -> list:
    key = json.dumps(choice)
    if key not in _whole:
        r = create(client, tool_choice=choice, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None, ch.message
        assert r.usage.completion_tokens <= MAX
        _whole[key] = ch.message.tool_calls
    return _whole[key]


@pytest.mark.parametrize("choice,only", CHOICES, ids=IDS)
def test_forced_tool_calls_non_stream(client, choice, only):
    check_calls(forced(client, choice), only, single=True)


def test_required_with_parallel_calls_and_seeded_sampling(client):
    for seed in (1, 2):
        r = create(client, tool_choice="required", temperature=0.9, seed=seed, max_tokens=96)
        ch = r.choices[0]
        if ch.finish_reason == "length":     # parallel calls may go on until max_tokens
            continue
        assert ch.finish_reason == "tool_calls"
        check_calls(ch.message.tool_calls)


@pytest.mark.parametrize("choice,only", CHOICES[:2], ids=IDS[:2])
def test_forced_tool_calls_stream_match_non_stream(client, choice, only):
    calls, content, finish = streamed(client, tool_choice=choice, parallel_tool_calls=False)
    assert finish == ["tool_calls"] and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in forced(client, choice)]
    for c in calls:
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_multi_turn_with_tool_results(client):
    first = create(client, tool_choice=named("get_weather"), parallel_tool_calls=False)
    msg = first.choices[0].message
    [(name, args)] = check_calls(msg.tool_calls, "get_weather", single=True)
    history = USER + [
        msg.model_dump(exclude_none=True),          # the assistant turn, as returned
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
         "content": json.dumps({"city": args["city"], "temp_c": 18, "sky": "sunny"})}]
    final = create(client, messages=history, tool_choice="none", max_tokens=24)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls
    # the history can be continued past the final answer
    longer = history + [{"role": "assistant", "content": final.choices[0].message.content},
                        {"role": "user", "content": "Thanks. And in Oslo?"}]
    r = create(client, messages=longer, tool_choice=named("get_weather"),
               parallel_tool_calls=False)
    check_calls(r.choices[0].message.tool_calls, "get_weather", single=True)


def test_auto_is_text_or_well_formed_calls(client):
    for seed in range(2):
        r = create(client, temperature=0.8, seed=seed, max_tokens=48)
        ch = r.choices[0]
        if ch.message.tool_calls:
            check_calls(ch.message.tool_calls)
            assert ch.finish_reason == "tool_calls"
        else:
            assert ch.finish_reason in ("stop", "length")
            assert "</tool_call>" not in (ch.message.content or "")


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt,
                                       max_tokens=MAX, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch
    jsonschema.validate(json.loads(ch.message.content), PERSON)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, response_format=fmt, max_tokens=MAX, temperature=0.9,
        seed=5, stream=True) if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_output_parses(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert isinstance(json.loads(ch.message.content), dict)
    else:
        assert ch.message.content.startswith("{")


def test_invalid_combinations_are_400_through_the_client(client):
    cases = [(dict(tool_choice=named("nope")), "tool_choice"),
             (dict(tools=openai.NOT_GIVEN, tool_choice="required"), "tool_choice"),
             (dict(tool_choice="required", response_format={"type": "json_object"}),
              "response_format"),
             (dict(tools=[fn("f", {"type": "object", "not": {}})]), "tools"),
             (dict(functions=[{"name": "f"}]), "functions")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            create(client, **kw)
        err = info.value.body
        assert err["message"] and err["type"] == "invalid_request_error", err
        assert err["param"] == param, err


# ---- fuzz ----------------------------------------------------------------------------------


def _sse(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def _send(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.text()


def _check_answer(body: dict, status: int, text: str) -> str:
    """One fuzz outcome: never a 5xx, a 4xx is an OpenAI error body, a 200 is well formed."""
    assert status < 500, (status, text, body)
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], text
        assert err["type"] == "invalid_request_error", text
        return "4xx"
    if body.get("stream"):
        events = _sse(text)
        assert events and events[-1] == "[DONE]", text
        assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), text
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]
                    if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert len(finishes) == 1, text
        for e in events[:-1]:
            for tc in (e.get("choices") or [{}])[0].get("delta", {}).get("tool_calls") or []:
                if tc["function"].get("arguments"):
                    json.loads(tc["function"]["arguments"])
        return "stream"
    data = json.loads(text)
    ch = data["choices"][0]
    assert ch["finish_reason"] in ("stop", "length", "tool_calls"), data
    for tc in ch["message"].get("tool_calls") or []:
        assert tc["type"] == "function" and tc["id"].startswith("call_")
        assert isinstance(json.loads(tc["function"]["arguments"]), dict)
    return "200"


def test_fuzzed_tool_and_format_bodies_never_get_a_5xx(mesh):
    rng = random.Random(20240604)
    bodies = [random_body(rng, max_tokens=(8, 16)) for _ in range(200)]

    async def run():
        sem = asyncio.Semaphore(16)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async def one(b):
                async with sem:
                    return await _send(http, mesh.url, b)
            return await asyncio.gather(*(one(b) for b in bodies))

    results = asyncio.run(run())
    seen: dict[str, int] = {}
    for b, (status, text) in zip(bodies, results):
        kind = _check_answer(b, status, text)
        seen[kind] = seen.get(kind, 0) + 1
    assert seen.get("4xx", 0) > 60 and seen.get("200", 0) + seen.get("stream", 0) > 60, seen
