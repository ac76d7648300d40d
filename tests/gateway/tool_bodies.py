"""Tool / response_format request bodies for tests: a pool of good tools (nested objects,
enums, arrays, optional fields) and a seeded generator of chat bodies mixing valid and
invalid tools, tool_choice, parallel_tool_calls, response_format and messages (garbage
types included). Shared by the pure validation tests and the e2e HTTP fuzz."""
from __future__ import annotations

import copy
import random

MODEL = "tiny-target"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight.",
    "parameters": {"type": "object", "properties": {
        "passenger": {"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]},
        "legs": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "class": {"type": "string", "enum": ["economy", "business"]}},
        "required": ["passenger", "legs"]}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm",
    "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "minute": {"type": "integer", "minimum": 0, "maximum": 59},
        "label": {"type": "string"}},
        "required": ["hour", "minute"]}}}
PING = {"type": "function", "function": {"name": "ping"}}          # no parameters at all
GOOD_TOOLS = [WEATHER, FLIGHT, ALARM, PING]

PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"}, "kind": {"type": "string", "enum": ["a", "b"]}},
    "required": ["name", "kind"]}

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def fn(name: str, parameters=None, **kw) -> dict:
    f = {"name": name, **kw}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def history(arguments='{"city": "Paris"}', call_id="call_1") -> list[dict]:
    """user -> assistant tool call -> tool result."""
    return USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 18, "sky": "sunny"}'}]


# ---- the fuzz generator --------------------------------------------------------------------

BAD_SCHEMAS = [
    {"type": "object", "not": {"required": ["x"]}},
    {"type": "object", "properties": {"x": {"type": "strin"}}},
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}},
    {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}},
    {"type": "object", "if": {}, "then": {}},
    {"type": "object", "allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"type": "string"},
    {"type": ["object", "null"]},
]
GARBAGE = [None, 0, -1, 3.5, True, "", "x", [], [1, 2], {}, {"a": 1}, [None], "required ",
           {"type": "function"}, {"function": "f"}, [[[]]]]


def _tools(rng: random.Random):
    r = rng.random()
    if r < 0.08:
        return "absent"
    if r < 0.12:
        return []
    if r < 0.55:
        return copy.deepcopy(rng.sample(GOOD_TOOLS, rng.randint(1, len(GOOD_TOOLS))))
    if r < 0.62:
        t = copy.deepcopy(rng.sample(GOOD_TOOLS, rng.randint(1, 3)))
        return t + [copy.deepcopy(t[0])]                         # duplicate name
    if r < 0.70:
        return [fn(rng.choice(["bad name", "", "x" * 65, "naïve", "a.b"]))]
    if r < 0.78:
        return [copy.deepcopy(WEATHER), fn("broken", rng.choice(BAD_SCHEMAS))]
    if r < 0.83:
        return [{"type": rng.choice(["retrieval", "code_interpreter", 7]),
                 "function": {"name": "f"}}]
    if r < 0.88:
        return [fn("f", rng.choice([[1], "object", 5, None]))]
    if r < 0.92:
        return [{"type": "function", "function": rng.choice(GARBAGE)}]
    return rng.choice(GARBAGE)


def _tool_choice(rng: random.Random, tools):
    names = [t["function"]["name"] for t in tools if isinstance(t, dict)
             and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
             ] if isinstance(tools, list) else []
    r = rng.random()
    if r < 0.2:
        return "absent"
    if r < 0.55:
        return rng.choice(["none", "auto", "required", "required", "auto"])
    if r < 0.75 and names:
        return named(rng.choice(names))
    if r < 0.82:
        return named(rng.choice(["nope", "get_weather", ""]))
    if r < 0.88:
        return {"type": rng.choice(["tool", "function_call", ""]), "function": {"name": "ping"}}
    if r < 0.92:
        return rng.choice(["any", "REQUIRED", "None"])
    return rng.choice(GARBAGE)


def _response_format(rng: random.Random):
    r = rng.random()
    if r < 0.55:
        return "absent"
    if r < 0.62:
        return {"type": "text"}
    if r < 0.72:
        return {"type": "json_object"}
    if r < 0.84:
        return {"type": "json_schema",
                "json_schema": {"name": "person", "schema": copy.deepcopy(PERSON_SCHEMA),
                                "strict": rng.choice([True, False])}}
    if r < 0.87:
        return {"type": "json_schema"}
    if r < 0.90:
        return {"type": "json_schema", "json_schema": {"name": "x"}}
    if r < 0.93:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": rng.choice(
            BAD_SCHEMAS + [5, "object", [], None])}}
    if r < 0.96:
        return {"type": rng.choice(["yaml", "JSON", "", "regex"])}
    return rng.choice(GARBAGE)


def _messages(rng: random.Random):
    r = rng.random()
    if r < 0.45:
        return copy.deepcopy(USER)
    if r < 0.65:
        return history(rng.choice(['{"city": "Paris"}', '{"city":"Paris","unit":"celsius"}',
                                   {"city": "Oslo"}, "", "not json", "[1, 2]"]))
    if r < 0.70:
        h = history()
        del h[2]["tool_call_id"]
        return h
    if r < 0.74:
        return USER + [{"role": "user", "content": "x", "tool_calls": history()[1]["tool_calls"]}]
    if r < 0.78:
        h = history()
        h[1]["tool_calls"][0]["type"] = rng.choice(["tool", 5])
        return h
    if r < 0.82:
        h = history()
        h[1]["tool_calls"][0]["function"] = rng.choice(GARBAGE)
        return h
    if r < 0.86:
        return [{"role": "tool", "content": rng.choice(["ok", None, 3]),
                 "tool_call_id": rng.choice(["c", None, 5])}]
    return rng.choice(GARBAGE)


def valid_body(rng: random.Random, max_tokens: tuple[int, int] = (8, 24)) -> dict:
    """A body the gateway must serve (200)."""
    messages = copy.deepcopy(USER) if rng.random() < 0.6 else history(rng.choice(
        ['{"city": "Paris"}', '{"city":"Oslo"}', {"city": "Rome"}]))
    body: dict = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(*max_tokens)}
    tools = copy.deepcopy(rng.sample(GOOD_TOOLS, rng.randint(1, len(GOOD_TOOLS)))) \
        if rng.random() < 0.8 else rng.choice([None, []])
    if tools is not None:
        body["tools"] = tools
    choices = ["absent", "none", "auto", "required"] + (
        [named(t["function"]["name"]) for t in tools] if tools else [])
    choice = rng.choice(choices if tools else ["absent", "none", "auto"])
    if choice != "absent":
        body["tool_choice"] = choice
    if not tools or choice == "none":
        body["response_format"] = rng.choice([
            {"type": "text"}, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "person",
                                                    "schema": copy.deepcopy(PERSON_SCHEMA)}}])
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = rng.choice([True, False])
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["seed"] = rng.randrange(1 << 31)
    return body


def random_body(rng: random.Random, max_tokens: tuple[int, int] = (8, 24)) -> dict:
    """One chat body: a valid one (about 40%), or fields drawn independently from valid and
    invalid choices, so most combinations of mistakes appear."""
    if rng.random() < 0.4:
        return valid_body(rng, max_tokens)
    body: dict = {"model": MODEL, "messages": _messages(rng),
                  "max_tokens": rng.randint(*max_tokens)}
    tools = _tools(rng)
    if tools != "absent":
        body["tools"] = tools
    choice = _tool_choice(rng, tools)
    if choice != "absent":
        body["tool_choice"] = choice
    fmt = _response_format(rng)
    if fmt != "absent":
        body["response_format"] = fmt
    if rng.random() < 0.2:
        body["parallel_tool_calls"] = rng.choice([True, False, False, "yes", None])
    if rng.random() < 0.04:
        body["functions"] = [{"name": "f", "parameters": {"type": "object"}}]
    if rng.random() < 0.04:
        body["function_call"] = rng.choice(["auto", {"name": "f"}])
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["seed"] = rng.randrange(1 << 31)
    return body
