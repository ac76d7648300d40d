"""Responses / Messages / tokenize bodies for tests: the chat fuzz bodies of tool_bodies.py
translated into each API's shape (garbage stays garbage), plus per-API mistakes, so the
fuzz covers the same mix of valid and invalid tools, tool_choice, formats and histories
on every endpoint."""
from __future__ import annotations

import copy
import json
import random

from tests.gateway.tool_bodies import GARBAGE, random_body


def _fn(tool):
    return tool.get("function") if isinstance(tool, dict) else None


def r_tool(tool):
    fn = _fn(tool)
    if not isinstance(fn, dict):
        return tool
    return {"type": tool.get("type"), **fn}


def a_tool(tool):
    fn = _fn(tool)
    if not isinstance(fn, dict):
        return tool
    out = {"name": fn.get("name"), "input_schema": fn.get("parameters", {"type": "object"})}
    if "description" in fn:
        out["description"] = fn["description"]
    return out


def r_choice(choice):
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return {"type": choice.get("type"), "name": choice["function"].get("name")}
    return choice


def a_choice(choice):
    if isinstance(choice, str):
        return {"type": {"required": "any"}.get(choice, choice)}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return {"type": "tool" if choice.get("type") == "function" else choice.get("type"),
                "name": choice["function"].get("name")}
    return choice


def r_input(messages):
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
        elif m.get("role") == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id"),
                        "output": m.get("content")})
        elif m.get("tool_calls"):
            for c in m["tool_calls"] if isinstance(m["tool_calls"], list) else [m["tool_calls"]]:
                fn = c.get("function") if isinstance(c, dict) else None
                fn = fn if isinstance(fn, dict) else {}
                args = fn.get("arguments")
                out.append({"type": "function_call", "call_id": c.get("id") if isinstance(
                    c, dict) else None, "name": fn.get("name"),
                    "arguments": args if isinstance(args, str) else json.dumps(args)})
        else:
            out.append({"role": m.get("role"), "content": m.get("content")})
    return out


def a_messages(messages):
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.get(
                "tool_call_id"), "content": m.get("content")}]})
        elif m.get("tool_calls"):
            blocks = []
            for c in m["tool_calls"] if isinstance(m["tool_calls"], list) else [m["tool_calls"]]:
                fn = c.get("function") if isinstance(c, dict) else None
                fn = fn if isinstance(fn, dict) else {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                blocks.append({"type": "tool_use", "id": c.get("id") if isinstance(c, dict)
                               else None, "name": fn.get("name"), "input": args})
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": m.get("role"), "content": m.get("content")})
    return out


def responses_body(rng: random.Random, max_tokens=(8, 16)) -> dict:
    chat = random_body(rng, max_tokens)
    body = {"model": chat["model"], "input": r_input(chat["messages"]),
            "max_output_tokens": chat["max_tokens"]}
    if "tools" in chat:
        body["tools"] = ([r_tool(t) for t in chat["tools"]] if isinstance(chat["tools"], list)
                         else chat["tools"])
    if "tool_choice" in chat:
        body["tool_choice"] = r_choice(chat["tool_choice"])
    rf = chat.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
        body["text"] = {"format": {"type": rf.get("type"), **rf["json_schema"]}}
    elif rf is not None:
        body["text"] = {"format": rf} if rng.random() < 0.8 else rf
    for k in ("parallel_tool_calls", "stream", "temperature", "seed"):
        if k in chat:
            body[k] = chat[k]
    return _mistakes(rng, body, RESPONSES_MISTAKES)


def messages_body(rng: random.Random, max_tokens=(8, 16)) -> dict:
    chat = random_body(rng, max_tokens)
    body = {"model": chat["model"], "messages": a_messages(chat["messages"]),
            "max_tokens": chat["max_tokens"]}
    if "tools" in chat:
        body["tools"] = ([a_tool(t) for t in chat["tools"]] if isinstance(chat["tools"], list)
                         else chat["tools"])
    if "tool_choice" in chat:
        body["tool_choice"] = a_choice(chat["tool_choice"])
    rf = chat.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
        body["output_config"] = {"format": {"type": "json_schema",
                                            "schema": rf["json_schema"].get("schema")}}
    for k in ("stream", "temperature", "seed"):
        if k in chat:
            body[k] = chat[k]
    return _mistakes(rng, body, MESSAGES_MISTAKES)


def tokenize_body(rng: random.Random) -> tuple[str, dict]:
    chat = random_body(rng)
    r = rng.random()
    if r < 0.35:
        body = {"messages": chat["messages"], "add_generation_prompt": rng.choice([True, False])}
        if "tools" in chat:
            body["tools"] = chat["tools"]
        return "/tokenize", _mistakes(rng, body, TOKENIZE_MISTAKES)
    if r < 0.6:
        return "/tokenize", _mistakes(rng, {"prompt": rng.choice(["def f():", "", "é" * 50])},
                                      TOKENIZE_MISTAKES)
    tokens = rng.choice([[1, 2, 3], [], [10 ** 9], [-1], list(range(50)), ["a"], None, 5])
    return "/detokenize", _mistakes(rng, {"tokens": tokens, "model": "tiny-target"},
                                    {"tokens": GARBAGE})


RESPONSES_MISTAKES = {
    "input": GARBAGE + [[{"type": "reasoning"}], [{"type": "item_reference", "id": "x"}],
                        [{"role": "user", "content": [{"type": "input_file"}]}]],
    "instructions": GARBAGE + ["Be brief."],
    "max_output_tokens": GARBAGE + [0, -5, 10 ** 8],
    "previous_response_id": GARBAGE + ["resp_missing"],
    "store": GARBAGE + [False],
    "text": GARBAGE + [{"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}],
    "truncation": GARBAGE + ["auto"],
    "temperature": GARBAGE + [3.0],
    "pdmesh_path": GARBAGE + ["pd", "colocated", "elsewhere"],
    "background": [True, "yes"],
    "tool_choice": GARBAGE + [{"type": "allowed_tools"}, {"type": "function"}],
}
MESSAGES_MISTAKES = {
    "messages": GARBAGE + [[{"role": "user", "content": [{"type": "image", "source": {}}]}],
                           [{"role": "assistant", "content": "prefill only"}]],
    "system": GARBAGE + [[{"type": "text", "text": "Be brief."}], [{"type": "image"}]],
    "max_tokens": GARBAGE + [0, 10 ** 8],
    "stop_sequences": GARBAGE + [["\n"], [""], ["a"] * 6],
    "temperature": GARBAGE + [1.5],
    "top_k": GARBAGE + [-3, 5],
    "thinking": GARBAGE + [{"type": "enabled", "budget_tokens": 100}],
    "pdmesh_path": GARBAGE + ["pd", "colocated", "elsewhere"],
    "tool_choice": GARBAGE + [{"type": "any", "disable_parallel_tool_use": True}],
    "output_config": GARBAGE + [{"format": {"type": "json_schema"}}, {"effort": "low"}],
}
TOKENIZE_MISTAKES = {
    "add_special_tokens": GARBAGE, "continue_final_message": GARBAGE + [True],
    "return_token_strs": GARBAGE + [True], "prompt": GARBAGE, "messages": GARBAGE,
    "model": GARBAGE + ["nope"],
}


def _mistakes(rng: random.Random, body: dict, choices: dict) -> dict:
    body = copy.deepcopy(body)
    for key in rng.sample(sorted(choices), min(len(choices), rng.choice([0, 0, 1, 1, 2]))):
        if rng.random() < 0.15:
            body.pop(key, None)
        else:
            body[key] = copy.deepcopy(rng.choice(choices[key]))
    return body
