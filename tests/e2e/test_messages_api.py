"""The Anthropic Messages API through the whole mesh (tiny model, deterministic mode) with
the official anthropic client: plain text, streaming (client.messages.stream), tool_choice
any / tool over PD with tool_use blocks whose input validates, a tool_result round trip,
stop_sequences, output_config json_schema, count_tokens, and bad requests in Anthropic's
error shape. Sampling fields (temperature, ...) go through extra_body: this client version
no longer declares them, the API still takes them."""
from __future__ import annotations

import json

import aiohttp
import anthropic
import jsonschema
import pytest

MODEL = "tiny-target"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}
HOUR = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                  "maximum": 23}}, "required": ["hour"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city.", "input_schema": CITY},
         {"name": "set_alarm", "input_schema": HOUR}]
SCHEMAS = {"get_weather": CITY, "set_alarm": HOUR}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(mesh):
    return anthropic.Anthropic(base_url=mesh.url, api_key="unused", max_retries=0, timeout=60)


def create(client, extra=None, **kw):
    return client.messages.create(**({"model": MODEL, "max_tokens": 96, "messages": USER} | kw),
                                  extra_body=GREEDY | (extra or {}))


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def test_plain_text_and_usage(client):
    m = create(client, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16,
               system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL and m.stop_reason in ("end_turn", "max_tokens")
    assert m.content[0].type == "text" and m.content[0].text
    u = m.usage
    assert 0 < u.output_tokens <= 16 and u.input_tokens + u.cache_read_input_tokens > 5


def test_stream_equals_whole(client):
    kw = dict(messages=[{"role": "user", "content": "import os\n"}], max_tokens=12)
    whole = create(client, **kw)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(kinds)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice,only", [({"type": "any"}, None),
                                          ({"type": "tool", "name": "set_alarm"}, "set_alarm")],
                         ids=["any", "tool"])
def test_tool_choice_over_pd(client, choice, only):
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=96, messages=USER, tools=TOOLS,
        tool_choice=choice | {"disable_parallel_tool_use": True},
        extra_body=GREEDY | {"pdmesh_path": "pd"})
    assert raw.headers["x-pdmesh-path"] == "pd"
    m = raw.parse()
    assert m.stop_reason == "tool_use"
    (use,) = tool_uses(m)
    assert use.id.startswith("toolu_") and (use.name == only if only else use.name in SCHEMAS)
    jsonschema.validate(use.input, SCHEMAS[use.name])


def test_stream_tool_use(client):
    kw = dict(model=MODEL, max_tokens=96, messages=USER, tools=TOOLS,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    with client.messages.stream(**kw, extra_body=GREEDY | {"pdmesh_path": "pd"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in events)
    (use,) = tool_uses(final)
    (want,) = tool_uses(create(client, **{k: v for k, v in kw.items() if k != "model"}))
    assert (use.name, use.input) == (want.name, want.input) and final.stop_reason == "tool_use"


def test_tool_result_round_trip(client):
    first = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = tool_uses(first)
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": use.id,
                           "content": [{"type": "text", "text": '{"temp_c": 18}'}]},
                          {"type": "text", "text": "Summarise."}]}]
    m = create(client, messages=history, tools=TOOLS, tool_choice={"type": "none"},
               max_tokens=24)
    assert m.stop_reason in ("end_turn", "max_tokens") and not tool_uses(m)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_stop_sequences(client):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    free = create(client, messages=msgs, max_tokens=24).content[0].text
    stop = free.strip().split()[1]                 # a word the greedy answer contains
    m = create(client, messages=msgs, max_tokens=24, stop_sequences=[stop, "zzzz"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text and free.startswith(m.content[0].text)


def test_output_config_json_schema(client):
    m = create(client, messages=[{"role": "user", "content": "A person, as JSON."}],
               max_tokens=80, output_config={"format": {"type": "json_schema",
                                                        "schema": PERSON}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


def test_prefill_continues_the_assistant_turn(client):
    """A last assistant message is continued: the answer is what follows its text."""
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    short = create(client, messages=msgs, max_tokens=6).content[0].text
    longer = create(client, messages=msgs, max_tokens=12).content[0].text
    m = create(client, messages=msgs + [{"role": "assistant", "content": short}], max_tokens=6)
    cont = m.content[0].text
    assert cont and longer.startswith(short + cont)     # token boundaries may shift by one


def test_count_tokens(client):
    n = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS).input_tokens
    m = create(client, tools=TOOLS, max_tokens=1)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.parametrize("kw,extra,words", [
    (dict(max_tokens=0), None, "max_tokens"),
    (dict(messages=[]), None, "messages"),
    (dict(messages=[{"role": "system", "content": "x"}]), None, "role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), None,
     "image"),
    (dict(), {"temperature": 1.5}, "temperature"),
    (dict(tool_choice={"type": "any"}), None, "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), None, "nope"),
    (dict(tools=[{"name": "bad name!", "input_schema": CITY}]), None, "name"),
    (dict(stop_sequences=["a", "b", "c", "d", "e"]), None, "stop"),
    (dict(max_tokens=10 ** 7), None, "context length"),
])
def test_bad_requests_get_anthropic_errors(client, kw, extra, words):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, extra, **kw)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert words in body["error"]["message"], body


def test_http_errors_in_anthropic_shape(mesh):
    import asyncio

    async def run():
        async with aiohttp.ClientSession() as http:
            out = []
            for method, data in (("POST", b"{nope"), ("POST", b"[]"), ("GET", None)):
                async with http.request(method, mesh.url + "/v1/messages", data=data) as r:
                    out.append((r.status, await r.json()))
            async with http.post(mesh.url + "/v1/messages", json={
                    "model": "claude-x", "max_tokens": 4, "messages": USER}) as r:
                out.append((r.status, await r.json()))
            return out

    got = asyncio.run(run())
    assert [s for s, _ in got] == [400, 400, 405, 404]
    for _status, body in got:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert got[3][1]["error"]["type"] == "not_found_error"
