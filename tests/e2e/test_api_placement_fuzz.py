"""The Responses and Messages APIs over the whole mesh: placement does not change their
output (PD == colocated, deterministic mode, greedy and seeded, text, tool calls, JSON,
streamed and not), they say what chat completions says for the same conversation, and a
fuzz of their bodies (and /tokenize, /detokenize) never gets a 5xx: every 4xx is in the
endpoint's own error shape, every 200 well formed."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from tests.gateway.api_bodies import messages_body, responses_body, tokenize_body

MODEL = "tiny-target"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the weather in Paris?"

RESPONSES = [
    dict(input="def add(a, b):", temperature=0, max_output_tokens=16),
    dict(input="import os\n", temperature=0.8, seed=7, max_output_tokens=16),
    dict(input=ASK, tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
         tool_choice="required", temperature=0, max_output_tokens=64),
    dict(input="A person.", text={"format": {"type": "json_schema", "name": "p",
                                             "schema": PERSON}}, temperature=0,
         max_output_tokens=64),
]
MESSAGES = [
    dict(messages=[{"role": "user", "content": "def add(a, b):"}], temperature=0, max_tokens=16),
    dict(messages=[{"role": "user", "content": "import os\n"}], temperature=0.9, seed=11,
         max_tokens=16),
    dict(messages=[{"role": "user", "content": ASK}], tools=[{"name": "get_weather",
                                                              "input_schema": CITY}],
         tool_choice={"type": "any"}, temperature=0, max_tokens=64),
]


def sse(raw: str) -> list[tuple[str | None, dict | str]]:
    out = []
    for block in raw.split("\n\n"):
        event, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


async def post(http, url: str, path: str, body: dict) -> tuple[int, str, dict]:
    async with http.post(url + path, json=body) as r:
        return r.status, await r.text(), dict(r.headers)


def r_output(status: int, text: str, stream: bool) -> list:
    assert status == 200, text
    if stream:
        events = sse(text)
        assert events[-1][0] in ("response.completed", "response.incomplete"), text
        resp = events[-1][1]["response"]
    else:
        resp = json.loads(text)
    return [(o["type"], o.get("name"), o.get("arguments"),
             [c["text"] for c in o.get("content", [])]) for o in resp["output"]] + \
        [resp["status"], resp["usage"]["output_tokens"]]


def m_output(status: int, text: str, stream: bool) -> list:
    assert status == 200, text
    if stream:
        events = sse(text)
        assert events[-1][0] == "message_stop", text
        blocks: dict[int, list] = {}
        for kind, data in events:
            if kind == "content_block_start":
                blocks[data["index"]] = [data["content_block"]["type"],
                                         data["content_block"].get("name"), ""]
            elif kind == "content_block_delta":
                d = data["delta"]
                blocks[data["index"]][2] += d.get("text", d.get("partial_json", ""))
        delta = next(d for k, d in events if k == "message_delta")
        content = [tuple(b) for _, b in sorted(blocks.items())]
        return content + [delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]]
    msg = json.loads(text)
    content = [(b["type"], b.get("name"), b.get("text", json.dumps(b.get("input"))))
               for b in msg["content"]]
    return content + [msg["stop_reason"], msg["usage"]["output_tokens"]]


def test_pd_equals_colocated(mesh):
    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
            for path, cases, norm in (("/v1/responses", RESPONSES, r_output),
                                      ("/v1/messages", MESSAGES, m_output)):
                for case in cases:
                    for stream in (False, True):
                        got = {}
                        for where in ("pd", "colocated"):
                            body = {"model": MODEL, **case, "stream": stream,
                                    "pdmesh_path": where}
                            status, text, headers = await post(http, mesh.url, path, body)
                            assert headers.get("x-pdmesh-path") == where, (path, text)
                            got[where] = norm(status, text, stream)
                        assert got["pd"] == got["colocated"], (path, case, stream, got)
                        if not stream:
                            whole = got["pd"]
                        else:
                            assert got["pd"] == whole or path == "/v1/messages" and \
                                [x[:2] for x in got["pd"][:-2]] == [x[:2] for x in whole[:-2]]

    asyncio.run(run())


def test_same_answer_as_chat_completions(mesh):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}]

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(60)) as http:
            chat = json.loads((await post(http, mesh.url, "/v1/chat/completions", {
                "model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0}))[1])
            resp = json.loads((await post(http, mesh.url, "/v1/responses", {
                "model": MODEL, "instructions": "Be brief.", "input": "def f():",
                "max_output_tokens": 12, "temperature": 0}))[1])
            msg = json.loads((await post(http, mesh.url, "/v1/messages", {
                "model": MODEL, "system": "Be brief.", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "def f():"}]}))[1])
            tok = json.loads((await post(http, mesh.url, "/tokenize", {
                "model": MODEL, "messages": msgs}))[1])
            return chat, resp, msg, tok

    chat, resp, msg, tok = asyncio.run(run())
    text = chat["choices"][0]["message"]["content"]
    assert resp["output"][0]["content"][0]["text"] == text == msg["content"][0]["text"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == tok["count"]


# ---- fuzz ----------------------------------------------------------------------------------


def check_openai_error(text: str) -> None:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], text
    assert err["type"] == "invalid_request_error", text


def check_responses(body: dict, status: int, text: str) -> str:
    if status >= 400:
        check_openai_error(text)
        return "4xx"
    if body.get("stream"):
        events = sse(text)
        assert events[-1][0] in ("response.completed", "response.incomplete"), text
        assert not any(k in ("error", "response.failed") for k, _ in events), text
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        resp = events[-1][1]["response"]
    else:
        resp = json.loads(text)
    assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
    for o in resp["output"]:
        if o["type"] == "function_call":
            assert isinstance(json.loads(o["arguments"]), dict) and o["call_id"]
        else:
            assert o["type"] == "message" and o["content"][0]["type"] == "output_text"
    return "200"


def check_messages(body: dict, status: int, text: str) -> str:
    if status >= 400:
        data = json.loads(text)
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, text
        assert data["error"]["message"], text
        return "4xx"
    if body.get("stream"):
        events = sse(text)
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop", text
        assert not any(k == "error" for k, _ in events), text
        for kind, data in events:
            if kind == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                assert isinstance(json.loads(data["delta"]["partial_json"]), dict)
        return "200"
    msg = json.loads(text)
    assert msg["type"] == "message" and msg["stop_reason"] in (
        "end_turn", "max_tokens", "stop_sequence", "tool_use"), text
    for b in msg["content"]:
        assert b["type"] in ("text", "tool_use")
        if b["type"] == "tool_use":
            assert isinstance(b["input"], dict) and b["id"].startswith("toolu_")
    return "200"


def check_tokenize(path: str, status: int, text: str) -> str:
    if status >= 400:
        check_openai_error(text)
        return "4xx"
    data = json.loads(text)
    if path == "/tokenize":
        assert data["count"] == len(data["tokens"]) and data["max_model_len"] > 0
    else:
        assert isinstance(data["prompt"], str)
    return "200"


def test_fuzzed_bodies_never_get_a_5xx(mesh):
    rng = random.Random(20261130)
    jobs = [("/v1/responses", responses_body(rng)) for _ in range(120)]
    jobs += [("/v1/messages", messages_body(rng)) for _ in range(120)]
    jobs += [tokenize_body(rng) for _ in range(60)]

    async def run():
        sem = asyncio.Semaphore(16)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            async def one(path, body):
                async with sem:
                    status, text, _ = await post(http, mesh.url, path, body)
                    return status, text
            return await asyncio.gather(*(one(p, b) for p, b in jobs))

    seen: dict[str, int] = {}
    for (path, body), (status, text) in zip(jobs, asyncio.run(run())):
        assert status < 500, (path, status, text, body)
        if path == "/v1/responses":
            kind = check_responses(body, status, text)
        elif path == "/v1/messages":
            kind = check_messages(body, status, text)
        else:
            kind = check_tokenize(path, status, text)
        key = f"{path} {kind}"
        seen[key] = seen.get(key, 0) + 1
    for path in ("/v1/responses", "/v1/messages"):
        assert seen.get(f"{path} 4xx", 0) > 20 and seen.get(f"{path} 200", 0) > 20, seen
