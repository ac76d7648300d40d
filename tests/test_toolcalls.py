"""Hermes tool-call text -> OpenAI tool_calls: the whole parse, and the stream parser, which
must give the same content and calls however the text is split into deltas."""
from __future__ import annotations

import json
import random

import pytest

from shared.toolcalls import Text, ToolCallStreamParser, call_id, openai_deltas, parse_tool_calls

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "Zürich"}]}}\n</tool_call>'

# text, expected content, expected [(name, arguments dict)]
CASES = [
    ("Just an answer.", "Just an answer.", []),
    ("", "", []),
    ("  spaced  out \n", "  spaced  out \n", []),
    (CALL_W, None, [("get_weather", {"city": "Paris"})]),
    ("\n" + CALL_W + "\n", None, [("get_weather", {"city": "Paris"})]),
    (CALL_W + "\n" + CALL_A, None, [("get_weather", {"city": "Paris"}),
                                    ("add", {"a": 1, "b": [2, {"c": "Zürich"}]})]),
    (CALL_W + " \n\n " + CALL_A + "\n\n", None, [("get_weather", {"city": "Paris"}),
                                                 ("add", {"a": 1, "b": [2, {"c": "Zürich"}]})]),
    ("Let me check.\n" + CALL_W, "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("Let me check." + CALL_W + "\nDone.", "Let me check.Done.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name":"f","arguments":{}}</tool_call>', None, [("f", {})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    # malformed blocks stay text, valid ones around them still parse
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('Hi <tool_call>{"arguments": {}}</tool_call>', 'Hi <tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>["f"]</tool_call>\n' + CALL_W, '<tool_call>["f"]</tool_call>',
     [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # unclosed (truncated by max_tokens) and nested open tags
    ('ok <tool_call>\n{"name": "f", "argu', 'ok <tool_call>\n{"name": "f", "argu', []),
    (CALL_W + '\n<tool_call>\n{"name"', '<tool_call>\n{"name"', [("get_weather", {"city": "Paris"})]),
    ('<tool_call> x <tool_call>{"name": "f"}</tool_call>',
     '<tool_call> x <tool_call>{"name": "f"}</tool_call>', []),
    # look-alikes are text
    ("a < b and <tool_c all>", "a < b and <tool_c all>", []),
    ("ends with <tool_cal", "ends with <tool_cal", []),
    ("</tool_call> stray", "</tool_call> stray", []),
]


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, request_id="req-1")
    assert got_content == content
    assert _names_args(got_calls) == calls
    for i, c in enumerate(got_calls):
        assert c["type"] == "function" and c["id"] == call_id("req-1", i)
        assert isinstance(c["function"]["arguments"], str)


def test_call_ids_are_deterministic_per_request_and_index():
    assert call_id("r", 0) == call_id("r", 0) != call_id("r", 1) != call_id("s", 1)
    for cid in (call_id("r", 0), call_id(None, 0)):
        assert cid.startswith("call_") and len(cid) == 5 + 24
        int(cid[5:], 16)
    assert call_id(None, 0) != call_id(None, 0)


def test_arguments_are_rendered_like_the_template():
    _, calls = parse_tool_calls('<tool_call>{"name":"f","arguments":{"a":1,"b":"é"}}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1, "b": "é"}'


def run_stream(text: str, pieces: list[str], request_id: str = "req-1", fmt: str | None = None,
               tools=None):
    """Feed pieces; return (content deltas, calls merged from their deltas, all deltas)."""
    parser = ToolCallStreamParser(request_id, fmt, tools)
    deltas = []
    for piece in pieces:
        deltas += openai_deltas(parser.feed(piece))
    deltas += openai_deltas(parser.finish())
    contents = [d["content"] for d in deltas if "content" in d]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "type": None, "name": "", "arguments": ""})
            if "id" in tc:
                assert c["id"] is None, "id sent twice"
                c["id"], c["type"] = tc["id"], tc["type"]
                c["name"] += tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    assert parser.has_tool_calls == bool(calls)
    merged = [{"id": c["id"], "type": c["type"],
               "function": {"name": c["name"], "arguments": c["arguments"]}}
              for _, c in sorted(calls.items())]
    return contents, merged, deltas


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)                                        # one character per delta
    for cut in range(len(text) + 1):                        # every two-piece split
        yield [text[:cut], text[cut:]]
    for _ in range(20):                                     # random chunkings, empty deltas too
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 8)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_parser_matches_whole_parse_for_any_split(text, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, request_id="req-1")
    rng = random.Random(text)
    for pieces in splits(text, rng):
        contents, merged, _ = run_stream(text, pieces)
        assert "".join(contents) == (whole_content or ""), pieces
        assert merged == whole_calls, pieces
        if "<" not in (whole_content or ""):
            assert not any("<" in c for c in contents), f"tag text leaked: {pieces}"


def test_stream_sends_call_header_then_arguments():
    _, _, deltas = run_stream(CALL_W, [CALL_W[:5], CALL_W[5:40], CALL_W[40:]])
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": call_id("req-1", 0), "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]


def test_stream_holds_partial_tag_and_releases_it_when_it_is_not_one():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool_") == [Text("Hello")]
    assert parser.feed("cab") == [Text(" <tool_cab")]
    assert parser.feed(" and <") == [Text(" and")]
    assert parser.finish() == [Text(" <")]


def test_stream_emits_plain_text_without_waiting():
    parser = ToolCallStreamParser()
    assert parser.feed("The answer") == [Text("The answer")]
    assert parser.feed(" is 42.") == [Text(" is 42.")]
    assert parser.finish() == []
