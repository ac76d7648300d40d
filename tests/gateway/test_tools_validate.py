"""Tools and structured output at the gateway, pure (no NATS): every refused combination is a
400 that names the parameter and says what is wrong; good bodies become the right
Constraint, prompt (tools and tool-call history rendered) and Options."""
from __future__ import annotations

import json
import random

import msgspec
import pytest

from services.gateway.protocol import OpenAIError
from services.gateway.validate import parse_chat
from shared.contracts.constraint import Constraint, ConstraintKind
from shared.engine.grammar import build_grammar

from .tool_bodies import (
    ALARM,
    BAD_SCHEMAS,
    FLIGHT,
    GOOD_TOOLS,
    PERSON_SCHEMA,
    PING,
    USER,
    WEATHER,
    fn,
    history,
    named,
    random_body,
    valid_body,
)

CANON = dict(separators=(",", ":"))


def chat(**kw) -> bytes:
    return json.dumps({"messages": USER} | kw).encode()


def err(body: bytes, spec) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_chat(body, spec)
    e = info.value
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["type"] == "invalid_request_error"
    return e


def canon(x) -> str:
    return json.dumps(x, **CANON)


JSON_SCHEMA_FMT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}

# (body, param, words the message must contain)
BAD = [
    # tool_choice
    (chat(tools=[WEATHER], tool_choice=named("nope")), "tool_choice", "'nope', which is not in"),
    (chat(tools=[WEATHER, ALARM], tool_choice=named("ping")), "tool_choice", "get_weather"),
    (chat(tool_choice="required"), "tool_choice", "no 'tools'"),
    (chat(tools=[], tool_choice="required"), "tool_choice", "no 'tools'"),
    (chat(tool_choice=named("get_weather")), "tool_choice", "no 'tools'"),
    (chat(tools=[WEATHER], tool_choice="any"), "tool_choice", "'none', 'auto', 'required'"),
    (chat(tools=[WEATHER], tool_choice="REQUIRED"), "tool_choice", "'REQUIRED'"),
    (chat(tools=[WEATHER], tool_choice={"type": "tool", "function": {"name": "get_weather"}}),
     "tool_choice.type", "'function'"),
    (chat(tools=[WEATHER], tool_choice=5), "tool_choice", "Expected"),
    (chat(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.function",
     "required"),
    (chat(tools=[WEATHER], tool_choice=["auto"]), "tool_choice", "Expected"),
    # tools
    (chat(tools=[WEATHER, ALARM, WEATHER]), "tools[2].function.name", "more than once"),
    (chat(tools=[fn("bad name")]), "tools[0].function.name", "a-z"),
    (chat(tools=[fn("")]), "tools[0].function.name", "a-z"),
    (chat(tools=[fn("x" * 65)]), "tools[0].function.name", "64"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type",
     "'function'"),
    (chat(tools=[{"type": "function"}]), "tools[0].function", "required"),
    (chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", "required"),
    (chat(tools={"type": "function"}), "tools", "Expected `array"),
    (chat(tools="get_weather"), "tools", "Expected `array"),
    (chat(tools=[5]), "tools[0]", "Expected `object"),
    (chat(tools=[fn("f", [1])]), "tools[0].function.parameters", "Expected `object"),
    (chat(tools=[fn("f", {"type": "string"})]), "tools[0].function.parameters", "'object'"),
    (chat(tools=[WEATHER, fn("f", {"type": "object", "not": {}})]), "tools", "'not'"),
    (chat(tools=[fn("f", {"type": "object", "properties": {"x": {"type": "strin"}}})]),
     "tools", "strin"),
    (chat(tools=[fn("f", {"type": "object", "properties": {"x": {"type": "string",
                                                                   "pattern": "(("}}})]),
     "tools", "parameters of tool 'f'"),
    (chat(tools=[fn("f", {"type": "object", "properties": {"x": {"type": "array",
                                                                   "uniqueItems": True}}})]),
     "tools", "uniqueItems"),
    (chat(tools=[fn(f"t{i}") for i in range(129)]), "tools", "at most 128"),
    # a bad tool is refused whatever tool_choice says (it is in the prompt either way)
    (chat(tools=[WEATHER, fn("f", {"type": "object", "if": {}})], tool_choice="none"), "tools",
     "'if'"),
    (chat(tools=[WEATHER, fn("f", {"type": "object", "if": {}})],
          tool_choice=named("get_weather")), "tools", "'if'"),
    # response_format
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "tool_choice 'required'"),
    (chat(tools=[WEATHER], tool_choice=named("get_weather"), response_format=JSON_SCHEMA_FMT),
     "response_format", "naming 'get_weather'"),
    (chat(tools=[WEATHER], response_format={"type": "json_object"}), "response_format",
     "'auto'"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "required"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "required"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": None}}),
     "response_format.json_schema.schema", "required"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}),
     "response_format.json_schema.schema", "Expected `object"),
    (chat(response_format={"type": "yaml"}), "response_format.type", "'yaml'"),
    (chat(response_format={"type": ""}), "response_format.type", "json_schema"),
    (chat(response_format="json"), "response_format", "Expected `object"),
    (chat(response_format={}), "response_format.type", "required"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}),
     "response_format.json_schema.schema", "'not'"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
     "response_format.json_schema.schema", "nope"),
    # deprecated forms
    (chat(functions=[{"name": "f"}]), "functions", "deprecated form of 'tools'"),
    (chat(function_call="auto"), "function_call", "deprecated"),
    (chat(function_call={"name": "f"}), "function_call", "tool_choice"),
    # messages
    (chat(messages=[{"role": "tool", "content": "18C"}]), "messages[0].tool_call_id",
     "required"),
    (chat(messages=USER + [{"role": "user", "content": "x",
                            "tool_calls": history()[1]["tool_calls"]}]),
     "messages[1].tool_calls", "only allowed in 'assistant'"),
    (chat(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "tool", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0].type", "'function'"),
    (chat(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0].function.name", "empty"),
    (chat(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function"}]}]), "messages[1].tool_calls[0].function", "required"),
    (chat(messages=USER + [{"role": "assistant", "content": None}]), "messages[1].content",
     "required"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_refused_with_400_naming_the_problem(spec, body, param, words):
    e = err(body, spec)
    assert e.status == 400, e
    assert e.param == param, e
    assert words.lower() in e.message.lower(), e.message


def test_deeply_nested_body_is_400_not_a_crash(spec):
    deep = "[" * 5000 + "]" * 5000
    body = b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + deep.encode() + b"}"
    assert err(body, spec).status == 400


def nested(levels: int) -> dict:
    schema: dict = {"type": "object", "properties": {"leaf": {"type": "string"}}}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_deeply_nested_schemas_are_refused_before_compiling(spec):
    """Compiling grows fast with depth (seconds at ~150 levels): a depth cap keeps one request
    from tying up the gateway and the engines."""
    ok = nested(12)
    parse_chat(chat(response_format={"type": "json_schema", "json_schema": {"schema": ok}}), spec)
    parse_chat(chat(tools=[fn("f", ok)]), spec)
    for levels in (40, 400):
        deep = nested(levels)
        e = err(chat(response_format={"type": "json_schema", "json_schema": {"schema": deep}}),
                spec)
        assert e.param == "response_format.json_schema.schema" and "too deeply" in e.message
        e = err(chat(tools=[WEATHER, fn("f", deep)]), spec)
        assert e.param == "tools[1].function.parameters" and "too deeply" in e.message


# ---- good bodies -> constraint, prompt, options ------------------------------------------


def test_tools_default_to_auto_with_canonical_tools_text(spec):
    tools = [WEATHER, FLIGHT]
    p = parse_chat(chat(tools=tools), spec)
    c = p.constraint
    assert c.kind is ConstraintKind.TOOLS_AUTO and c.tool_name is None and c.json_schema is None
    assert c.tools == canon(tools) and c.parallel_tool_calls
    assert p.options.tool_calls
    assert p.prompt_ids == spec.tokenizer.encode_chat(USER, tools=tools)
    text = spec.tokenizer.decode(p.prompt_ids)
    assert "<tools>" in text and '"book_flight"' in text and "passenger" in text
    assert parse_chat(chat(tools=tools, tool_choice="auto"), spec).constraint == c


def test_required_named_and_parallel_flag(spec):
    tools = [WEATHER, ALARM, PING]
    c = parse_chat(chat(tools=tools, tool_choice="required"), spec).constraint
    assert c == Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=canon(tools))
    c = parse_chat(chat(tools=tools, tool_choice="required", parallel_tool_calls=False),
                   spec).constraint
    assert c.kind is ConstraintKind.TOOLS_REQUIRED and c.parallel_tool_calls is False
    p = parse_chat(chat(tools=tools, tool_choice=named("set_alarm")), spec)
    assert p.constraint == Constraint(kind=ConstraintKind.TOOL_NAMED, tools=canon(tools),
                                      tool_name="set_alarm")
    assert p.options.tool_calls


def test_tool_choice_none_renders_tools_but_does_not_constrain_or_parse(spec):
    p = parse_chat(chat(tools=[WEATHER], tool_choice="none"), spec)
    assert p.constraint == Constraint() and not p.options.tool_calls
    assert p.prompt_ids == spec.tokenizer.encode_chat(USER, tools=[WEATHER])
    assert "get_weather" in spec.tokenizer.decode(p.prompt_ids)


def test_no_tools_means_no_constraint(spec):
    for kw in ({}, {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"},
               {"tools": [], "tool_choice": "auto"}, {"response_format": {"type": "text"}},
               {"parallel_tool_calls": False}):
        p = parse_chat(chat(**kw), spec)
        assert p.constraint == Constraint() and not p.options.tool_calls, kw
        assert p.prompt_ids == spec.tokenizer.encode_chat(USER)


def test_response_formats(spec):
    p = parse_chat(chat(response_format={"type": "json_object"}), spec)
    assert p.constraint == Constraint(kind=ConstraintKind.JSON_OBJECT)
    assert not p.options.tool_calls
    p = parse_chat(chat(response_format=JSON_SCHEMA_FMT), spec)
    assert p.constraint == Constraint(kind=ConstraintKind.JSON_SCHEMA,
                                      json_schema=canon(PERSON_SCHEMA))
    # strict false is still served strictly; name is optional (like vLLM)
    loose = {"type": "json_schema", "json_schema": {"schema": PERSON_SCHEMA, "strict": False}}
    assert parse_chat(chat(response_format=loose), spec).constraint == p.constraint


def test_response_format_with_tool_choice_none_is_json_with_tools_in_the_prompt(spec):
    p = parse_chat(chat(tools=[WEATHER], tool_choice="none", response_format=JSON_SCHEMA_FMT),
                   spec)
    assert p.constraint.kind is ConstraintKind.JSON_SCHEMA and not p.options.tool_calls
    assert "get_weather" in spec.tokenizer.decode(p.prompt_ids)


def test_constraint_text_is_compact_keeps_property_order_and_drops_unknown_fields(spec):
    """Keys are not sorted: xgrammar generates properties in schema order, so sorting would
    force alphabetical arguments (address, item, ...) instead of the declared order."""
    with_extras = {"type": "function", "extra": [1],
                   "function": {**FLIGHT["function"], "strict": True, "x-extra": 1}}
    a = parse_chat(chat(tools=[FLIGHT], tool_choice="required"), spec).constraint
    b = parse_chat(chat(tools=[with_extras], tool_choice="required"), spec).constraint
    assert a == b and " " not in a.tools.replace("Book a flight.", "")
    assert a.tools.index('"passenger"') < a.tools.index('"legs"') < a.tools.index('"class"')
    order = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}}
    c = parse_chat(chat(response_format={"type": "json_schema", "json_schema": {"schema": order}}),
                   spec).constraint
    assert c.json_schema == ('{"type":"object","properties":{"z":{"type":"string"},'
                             '"a":{"type":"string"}}}')


def test_constraints_survive_the_contract_and_build(spec):
    from shared.contracts.messages import DecodeSubmit
    from shared.contracts.sampling import SamplingParams

    bodies = [chat(tools=GOOD_TOOLS), chat(tools=GOOD_TOOLS, tool_choice="required"),
              chat(tools=GOOD_TOOLS, tool_choice=named("book_flight")),
              chat(response_format={"type": "json_object"}), chat(response_format=JSON_SCHEMA_FMT)]
    for body in bodies:
        c = parse_chat(body, spec).constraint
        assert build_grammar(c) is not None
        sub = DecodeSubmit(request_id="r", prompt_ids=[1], params=SamplingParams(max_tokens=1),
                           constraint=c, tokenizer_fingerprint="f", reply_subject="s")
        assert msgspec.json.decode(msgspec.json.encode(sub), type=DecodeSubmit).constraint == c


def test_multi_turn_history_renders_calls_as_generated(spec):
    """A tool call sent back in history renders the way the model writes one (json.dumps
    spacing), whether the client sent compact text, spaced text or an object."""
    expected = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
               '"celsius"}}\n</tool_call>'
    prompts = set()
    for args in ('{"city":"Paris","unit":"celsius"}', '{"city": "Paris", "unit": "celsius"}',
                 {"city": "Paris", "unit": "celsius"}):
        msgs = history(args) + [{"role": "user", "content": "And in Oslo?"}]
        p = parse_chat(chat(messages=msgs, tools=[WEATHER]), spec)
        text = spec.tokenizer.decode(p.prompt_ids)
        assert expected in text, text
        assert "<tool_response>" in text and '"temp_c": 18' in text
        prompts.add(tuple(p.prompt_ids))
    assert len(prompts) == 1
    # arguments that are not a JSON object are rendered as given, not refused
    p = parse_chat(chat(messages=history("not json"), tools=[WEATHER]), spec)
    assert '"arguments": not json}' in spec.tokenizer.decode(p.prompt_ids)


def test_history_without_tools_renders_through_the_template(spec):
    p = parse_chat(chat(messages=history() + [{"role": "tool", "tool_call_id": "call_2",
                                               "content": [{"type": "text", "text": "more"}]}]),
                   spec)
    text = spec.tokenizer.decode(p.prompt_ids)
    assert "<tool_call>" in text and "more" in text and p.constraint == Constraint()


def test_assistant_text_and_calls_together(spec):
    msgs = USER + [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Rome"}'}},
        {"id": "b", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "20C"},
        {"role": "tool", "tool_call_id": "b", "content": "pong"}]
    p = parse_chat(chat(messages=msgs, tools=[WEATHER, PING], tool_choice="auto"), spec)
    text = spec.tokenizer.decode(p.prompt_ids)
    assert "Let me check." in text and '"name": "ping"' in text and "pong" in text


def test_hermes_template_renders_tools_and_history():
    """The fallback template (models whose own template has no tools) renders them too."""
    from transformers import AutoTokenizer

    from shared.engine.tokenizer import _tool_template
    from tests.conftest import TINY_TARGET

    hf = AutoTokenizer.from_pretrained(TINY_TARGET)
    msgs = history({"city": "Paris"})
    text = hf.apply_chat_template(msgs, tools=[WEATHER], chat_template=_tool_template(),
                                  tokenize=False, add_generation_prompt=True)
    assert '"get_weather"' in text and "<tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


# ---- property: nothing but a Prepared or a 4xx ----------------------------------------------


def test_random_bodies_never_raise_anything_but_a_4xx(spec):
    rng = random.Random(1234)
    outcomes = {"ok": 0, "4xx": 0}
    kinds = set()
    for _ in range(400):
        body = random_body(rng)
        try:
            p = parse_chat(json.dumps(body).encode(), spec)
        except OpenAIError as e:
            assert 400 <= e.status < 500, (e, body)
            assert e.message and e.body()["error"]["type"] == "invalid_request_error"
            outcomes["4xx"] += 1
            continue
        outcomes["ok"] += 1
        kinds.add(p.constraint.kind)
        assert p.options.tool_calls == (p.constraint.kind in (
            ConstraintKind.TOOLS_AUTO, ConstraintKind.TOOLS_REQUIRED, ConstraintKind.TOOL_NAMED))
    assert outcomes["ok"] > 150 and outcomes["4xx"] > 150, outcomes
    assert kinds == set(ConstraintKind), kinds


def test_valid_bodies_are_all_served(spec):
    rng = random.Random(7)
    for _ in range(100):
        body = valid_body(rng)
        parse_chat(json.dumps(body).encode(), spec)


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
def test_every_bad_schema_is_refused_in_tools_and_in_response_format(spec, schema):
    assert err(chat(tools=[fn("f", schema)]), spec).status == 400
    if schema.get("type") == "object":
        e = err(chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}),
                spec)
        assert e.param == "response_format.json_schema.schema"
