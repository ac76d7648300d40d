"""Tool calls in the formats model families speak (shared/toolformats.py): each parsed
whole and streamed (any split gives the whole parse), malformed blocks kept as text, the
format picked from a chat template, and the grammar a constrained call follows accepting
exactly what the format's parser reads back as calls."""
from __future__ import annotations

import json
import random

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.engine.grammar.build import ConstraintError, build_grammar
from shared.toolcalls import parse_tool_calls
from shared.toolformats import FORMATS, detect

from .test_toolcalls import run_stream, splits

W = ("get_weather", {"city": "Paris", "days": 2})
P = ("ping", {})
GLM_TOOLS = {"get_weather": {"properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}}}}

# fmt, text, expected content, expected [(name, args)]
CASES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
     None, [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '
     '{"city": "Paris", "days": 2}}', None, [W]),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "ping", "parameters": {}}', None, [W, P]),
    ("llama3_json", '{"name": "ping", "arguments": {}}', None, [P]),
    # text first: an answer, not a call (as vLLM's llama3_json reads it)
    ("llama3_json", 'Sure: {"name": "ping", "parameters": {}}',
     'Sure: {"name": "ping", "parameters": {}}', []),
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),
    ("llama3_json", '{"name": "ping", "parameters": {}', '{"name": "ping", "parameters": {}', []),
    ("llama3_json", "Plain answer.", "Plain answer.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}, {"name": "ping", "arguments": {}}]', None, [W, P]),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "ping", "arguments": {}}]',
     "Let me look.", [P]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', None, [W]),
    ("mistral", '[TOOL_CALLS][{"name": "ping"}][TOOL_CALLS][{"name": "get_weather", '
     '"arguments": {"city": "Paris", "days": 2}}]', None, [P, W]),
    ("mistral", "[TOOL_CALLS][not json", "[TOOL_CALLS][not json", []),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", None, [W]),
    ("glm45", "Checking.\n<tool_call>ping\n</tool_call>\n<tool_call>get_weather\n"
     "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>2</arg_value>\n</tool_call>", "Checking.", [P, W]),
    # a string property stays a string even when it reads as JSON
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
     "</tool_call>", None, [("get_weather", {"city": "123"})]),
    ("glm45", "<tool_call>get weather\n</tool_call>", "<tool_call>get weather\n</tool_call>", []),
    ("glm45", "<tool_call>ping\nstray</tool_call>", "<tool_call>ping\nstray</tool_call>", []),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [P]),
]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_each_format_parses_whole_and_streamed_alike(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, "req-1", fmt, GLM_TOOLS)
    assert (got_content, _calls(got)) == (content, calls)
    for pieces in splits(text, random.Random(text)):
        contents, merged, _ = run_stream(text, pieces, fmt=fmt, tools=GLM_TOOLS)
        assert "".join(contents) == (content or ""), pieces
        assert merged == got, pieces


def test_the_format_comes_from_the_chat_template():
    assert detect("{{ '<tool_call>' }}{{ tc.name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert detect("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") == "hermes"
    assert detect('<|start_header_id|>ipython<|end_header_id|>{"name": .. "parameters"') \
        == "llama3_json"
    assert detect("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("") == detect(None) == "hermes"


TOOLS = json.dumps([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}}])
# one call, and two, exactly as each format's grammar spells them
SPELLED = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
               '\n</tool_call>', '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
                    '; {"name": "ping", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
                ', {"name": "ping", "arguments": {}}'),
    "glm45": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
              "\n<tool_call>ping\n</tool_call>"),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_required_call_is_constrained_to_what_the_parser_reads(fmt):
    first, second = SPELLED[fmt]
    close = "]" if fmt == "mistral" else ""
    one, two = first + close, first + second + close
    req = build_grammar(Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=TOOLS,
                                   tool_format="" if fmt == "hermes" else fmt))
    single = build_grammar(Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=TOOLS,
                                      tool_format=fmt, parallel_tool_calls=False))
    named = build_grammar(Constraint(kind=ConstraintKind.TOOL_NAMED, tools=TOOLS,
                                     tool_name="get_weather", tool_format=fmt))
    assert accepts(req, one) and accepts(req, two) and accepts(single, one)
    assert not accepts(single, two) and accepts(named, one) and not accepts(named, two)
    assert not accepts(req, "The weather is fine.")
    for text, n in ((one, 1), (two, 2)):
        content, calls = parse_tool_calls(text, "r", fmt, GLM_TOOLS)
        assert content is None and [c["function"]["name"] for c in calls] == \
            ["get_weather", "ping"][:n]
    others = [SPELLED[o][0] + ("]" if o == "mistral" else "") for o in FORMATS if o != fmt]
    assert not any(accepts(req, t) for t in others), "another format's call got through"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_auto_lets_text_through_and_constrains_a_call_once_it_starts(fmt):
    auto = build_grammar(Constraint(kind=ConstraintKind.TOOLS_AUTO, tools=TOOLS, tool_format=fmt))
    first = SPELLED[fmt][0] + ("]" if fmt == "mistral" else "")
    assert accepts(auto, "No call needed.") and accepts(auto, first)


def test_glm_arguments_hold_required_properties_in_schema_order():
    req = build_grammar(Constraint(kind=ConstraintKind.TOOL_NAMED, tools=TOOLS,
                                   tool_name="get_weather", tool_format="glm45"))
    no_city = "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    bad_days = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>two</arg_value>\n</tool_call>")
    assert not accepts(req, no_city) and not accepts(req, bad_days)


def test_an_unknown_format_is_a_clear_error():
    with pytest.raises(ConstraintError, match="unknown tool-call format 'xml'"):
        build_grammar(Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=TOOLS,
                                 tool_format="xml"))


def test_a_marker_held_as_a_special_token_survives_detokenizing(tiny_target, tmp_path):
    """Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|> are special tokens: decoding
    with special tokens skipped (as every answer is) must keep them, or the parser never
    sees a call; other special tokens stay skipped."""
    from transformers import AutoTokenizer

    from shared.engine.tokenizer import IncrementalDetokenizer, Tokenizer

    hf = AutoTokenizer.from_pretrained(tiny_target)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>",
                                                        "<|secret|>"]})
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    text = '<|secret|>[TOOL_CALLS][{"name": "ping", "arguments": {}}]'
    ids = tok.encode(text)
    assert tok.hf.convert_ids_to_tokens(ids[1]) == "[TOOL_CALLS]"      # one special token
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(detok.step(i) for i in ids) + detok.flush()
    assert out == text.removeprefix("<|secret|>")
    assert parse_tool_calls(out, "r", "mistral")[1][0]["function"]["name"] == "ping"


def test_glm_raw_strings_keep_their_schema_bounds():
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}])
    g = build_grammar(Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=tools,
                                 tool_format="glm45"))
    call = ("<tool_call>f\n<arg_key>city</arg_key>\n<arg_value>{}</arg_value>\n"
            "<arg_key>unit</arg_key>\n<arg_value>{}</arg_value>\n</tool_call>")
    assert accepts(g, call.format("Paris", "c"))
    assert not accepts(g, call.format("Zurich", "c")) and not accepts(g, call.format("Rome", "k"))
