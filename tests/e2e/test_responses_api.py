"""The OpenAI Responses API through the whole mesh (tiny model, deterministic mode) with the
official openai client: plain text, streaming (client.responses.stream), tool_choice
required / named over PD with function_call items whose arguments validate, a
function_call_output fed back (inline and through previous_response_id), text.format
json_schema, store / retrieve / delete, and errors in OpenAI's shape."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "tiny-target"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": CITY}
ALARM = {"type": "function", "name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"]}}
TOOLS = [WEATHER, ALARM]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def create(client, **kw):
    return client.responses.create(**({"model": MODEL, "input": ASK, "temperature": 0,
                                       "max_output_tokens": 96} | kw))


def calls_of(response) -> list:
    return [o for o in response.output if o.type == "function_call"]


def test_plain_text_and_usage(client):
    r = create(client, input="def add(a, b):", max_output_tokens=16, instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    u = r.usage
    assert u.input_tokens > 5 and 0 < u.output_tokens <= 16
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert r.instructions == "Be brief."


def test_stream_equals_whole(client):
    kw = dict(input="import os\n", max_output_tokens=12)
    whole = create(client, **kw)
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(seq)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice,only", [("required", None),
                                          ({"type": "function", "name": "set_alarm"},
                                           "set_alarm")], ids=["required", "named"])
def test_tool_choice_over_pd(client, choice, only):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        temperature=0, max_output_tokens=96, extra_body={"pdmesh_path": "pd"})
    assert raw.headers["x-pdmesh-path"] == "pd"
    r = raw.parse()
    assert r.status == "completed"
    (call,) = calls_of(r)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.name == only if only else call.name in ("get_weather", "set_alarm")
    schema = WEATHER["parameters"] if call.name == "get_weather" else ALARM["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert r.tool_choice == choice or r.tool_choice.name == only


def test_stream_tool_call_events(client):
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=96, extra_body={"pdmesh_path": "pd"}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = calls_of(final)
    assert call.arguments == args
    whole = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (want,) = calls_of(whole)
    assert (call.name, call.arguments) == (want.name, want.arguments)


def test_function_call_output_fed_back(client):
    first = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    (call,) = calls_of(first)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temp_c": 18, "sky": "sunny"})}
    # inline: the whole conversation as items
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, result]
    inline = create(client, input=items, tools=[WEATHER], max_output_tokens=24)
    # stored: previous_response_id continues the first response
    cont = create(client, input=[result], previous_response_id=first.id, tools=[WEATHER],
                  max_output_tokens=24)
    assert cont.previous_response_id == first.id
    for r in (inline, cont):
        assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 40
    assert cont.usage.input_tokens == inline.usage.input_tokens
    assert [o.model_dump(exclude={"id"}) for o in cont.output] == \
        [o.model_dump(exclude={"id"}) for o in inline.output]


def test_json_schema_output(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                      "strict": True}}
    r = create(client, input="Describe a person as JSON.", text=fmt, max_output_tokens=80)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input="A person, JSON.", text=fmt,
                                 temperature=0.9, max_output_tokens=80,
                                 extra_body={"seed": 3}) as s:
        final = s.get_final_response()
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_store_retrieve_delete(client):
    r = create(client, input="hi", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = create(client, input="hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="more", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("kw,param", [
    (dict(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type"),
    (dict(input=""), "input"),
    (dict(tools=[{"type": "web_search_preview"}]), "tools[0].type"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(tools=[WEATHER], tool_choice="required",
          text={"format": {"type": "json_object"}}), "text.format"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(max_output_tokens=10 ** 7), "max_output_tokens"),
    (dict(temperature=9), "temperature"),
    (dict(truncation="auto"), "truncation"),
])
def test_bad_requests_are_400_in_openai_shape(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert err["param"] == param, err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        create(client, model="gpt-x")
    assert info.value.body["code"] == "model_not_found"
