"""Synthetic chat and tool-call dialogues for the tiny bundled models, and their chat template.

Everything is generated from a seeded `random.Random`, so the same seed gives the same
dialogues. A tool dialogue looks like what the gateway sends and expects back:

    system  (tools rendered by the template as JSON inside <tools></tools>)
    user    "Please look up the weather with city Paris and units metric."
    assistant  tool_calls=[{"function": {"name": ..., "arguments": {...}}}]
    tool    {"status": "ok", ...}
    assistant  "Done: ..."

Arguments always satisfy the tool's JSON schema (types, enums, nested objects, arrays,
required keys), and the user's request names every argument value, so a model can learn to
copy them into the call.
"""

from __future__ import annotations

import json
import random

ENDOFTEXT = "<|endoftext|>"
# (token, special): special tokens are dropped by decode(skip_special_tokens=True); the tool
# tags are not, so a detokenized stream still shows <tool_call>...</tool_call> to the parser.
ADDED_TOKENS = [
    (ENDOFTEXT, True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
]
DEFAULT_SYSTEM = "You are a helpful assistant."

# ChatML / Hermes, same output format as shared/engine/templates/hermes_tools.jinja
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is mapping -%}{{ content | tojson }}
{%- elif content is iterable -%}
{%- for part in content if part.type == 'text' %}{{ part.text }}{% endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_text = render_content(messages[0].content) -%}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system_text = 'You are a helpful assistant.' -%}
{%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system_text }}
{%- if tools %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' }}{{ tool | tojson }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- set text = render_content(message.content) %}
{%- if text %}{{ '\n' + text }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\n<tool_call>\n{"name": ' }}{{ call.name | tojson }}{{ ', "arguments": ' }}
{%- if call.arguments is string and call.arguments | trim %}{{ call.arguments | trim }}
{%- elif call.arguments is mapping %}{{ call.arguments | tojson }}
{%- else %}{{ '{}' }}{% endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
    """Render with transformers' own Jinja environment, so training text is byte-identical
    to what `tokenizer.apply_chat_template` produces at serving time."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [messages], tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt
    )
    return rendered[0]


# vocabulary for tools, arguments and requests

VERBS = ["get", "search", "create", "update", "delete", "list", "send", "convert", "calculate", "find",
         "book", "schedule", "fetch", "translate", "summarize", "lookup", "check", "set", "add", "cancel"]
NOUNS = ["weather", "file", "event", "email", "currency", "stock_price", "flight", "hotel", "reminder",
         "user", "order", "invoice", "recipe", "route", "timer", "note", "repository", "issue",
         "playlist", "ticket", "contact", "meeting", "payment", "product", "document", "alarm"]
WORDS = ["alpha", "blue", "river", "quick", "report", "summer", "budget", "garden", "rocket", "piano",
         "coffee", "travel", "python", "server", "window", "market", "silver", "forest", "cloud", "paper"]
CITIES = ["Paris", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Austin", "Seoul", "Madrid", "Nairobi",
          "Toronto", "Sydney", "Mumbai", "Rome", "Dublin", "Denver"]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Peru": "Lima", "Egypt": "Cairo",
            "Norway": "Oslo", "Spain": "Madrid", "Kenya": "Nairobi", "Italy": "Rome", "Ireland": "Dublin",
            "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Brazil": "Brasilia"}
ENUMS = {"units": ["metric", "imperial"], "priority": ["low", "medium", "high"],
         "currency": ["USD", "EUR", "JPY", "GBP"], "format": ["json", "csv", "text"],
         "status": ["open", "closed", "pending"], "sort": ["asc", "desc"], "mode": ["fast", "accurate"]}
SYSTEMS = [DEFAULT_SYSTEM, "You are a concise assistant.", "You are a coding assistant.",
           "Answer briefly and precisely.", "You are a friendly assistant that uses tools when needed."]


def _phrase(rng: random.Random, n: int = 2) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _param_schema(rng: random.Random, name: str, depth: int) -> dict:
    """A JSON schema for one parameter; `name` picks a plausible type."""
    if name in ENUMS:
        return {"type": "string", "enum": ENUMS[name], "description": f"The {name}."}
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "array", "object"] if depth == 0
                      else ["string", "integer", "number", "boolean"])
    desc = f"The {name.replace('_', ' ')}."
    if kind == "array":
        return {"type": "array", "items": {"type": rng.choice(["string", "integer"])}, "description": desc}
    if kind == "object":
        keys = rng.sample(["street", "city", "zip", "lat", "lon", "min", "max", "label", "enabled", "unit"], 2)
        props = {k: _param_schema(rng, k, depth + 1) for k in keys}
        return {"type": "object", "properties": props, "required": list(keys), "description": desc}
    return {"type": kind, "description": desc}


def random_tool(rng: random.Random) -> dict:
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    names = rng.sample(["city", "query", "limit", "units", "priority", "tags", "ids", "date", "title",
                        "amount", "currency", "location", "address", "filters", "count", "path",
                        "recursive", "format", "status", "sort", "mode", "user_id", "max_results",
                        "language", "message", "radius_km", "include_archived", "options"],
                       rng.randint(1, 4))
    props = {n: _param_schema(rng, n, 0) for n in names}
    required = [n for i, n in enumerate(names) if i == 0 or rng.random() < 0.5]
    return {"type": "function", "function": {
        "name": f"{verb}_{noun}",
        "description": f"{verb.capitalize()} a {noun.replace('_', ' ')}.",
        "parameters": {"type": "object", "properties": props, "required": required}}}


def random_value(rng: random.Random, schema: dict, name: str = ""):
    """A value that validates against `schema`."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        if name == "city":
            return rng.choice(CITIES)
        if name == "date":
            return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return _phrase(rng, rng.randint(1, 3))
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(-100, 100), rng.randint(1, 2))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        item = schema["items"]
        return [random_value(rng, item) for _ in range(rng.randint(1, 3))]
    return {k: random_value(rng, s, k) for k, s in schema["properties"].items()}


def random_arguments(rng: random.Random, tool: dict) -> dict:
    params = tool["function"]["parameters"]
    return {k: random_value(rng, s, k) for k, s in params["properties"].items()
            if k in params["required"] or rng.random() < 0.5}


def _say(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(_say(v) for v in value)
    if isinstance(value, dict):
        return " and ".join(f"{k} {_say(v)}" for k, v in value.items())
    return str(value)


def ask_for_call(rng: random.Random, tool: dict, args: dict) -> str:
    fn = tool["function"]
    action = fn["name"].replace("_", " ")
    parts = [f"{k.replace('_', ' ')} {_say(v)}" for k, v in args.items()]
    detail = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] if parts else ""
    template = rng.choice(["Please {a} with {d}.", "Can you {a}? Use {d}.", "I need to {a} for {d}.",
                           "{A} with {d}, please.", "Could you {a} using {d}?"])
    return template.format(a=action, A=action.capitalize(), d=detail)


def tool_result(rng: random.Random, call: dict) -> dict:
    result = {"status": "ok", call["name"].split("_", 1)[1]: _phrase(rng, rng.randint(1, 3))}
    if rng.random() < 0.5:
        result["count"] = rng.randint(0, 20)
    return result


def tool_dialogue(rng: random.Random) -> tuple[list[dict], list[dict]]:
    tools = [random_tool(rng) for _ in range(rng.randint(1, 4))]
    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.15:  # a request no tool serves: answer in text
        messages += plain_turns(rng, 1)
        return messages, tools
    chosen = rng.sample(tools, 2) if len(tools) > 1 and rng.random() < 0.2 else [rng.choice(tools)]
    calls = [{"name": t["function"]["name"], "arguments": random_arguments(rng, t)} for t in chosen]
    messages.append({"role": "user", "content": " Also, ".join(
        ask_for_call(rng, t, c["arguments"]) for t, c in zip(chosen, calls))})
    as_string = rng.random() < 0.3  # clients send arguments as a JSON string or an object
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": c["name"],
                                          "arguments": json.dumps(c["arguments"]) if as_string else c["arguments"]}}
        for c in calls]})
    results = [tool_result(rng, c) for c in calls]
    for r in results:
        messages.append({"role": "tool", "content": json.dumps(r)})
    summary = "; ".join(", ".join(f"{k} {_say(v)}" for k, v in r.items() if k != "status") for r in results)
    messages.append({"role": "assistant", "content": rng.choice(["Done: ", "Here is the result: ", "Result: "]) + summary + "."})
    return messages, tools


def plain_qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        country = rng.choice(list(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    if kind == 3:
        w = rng.choice(WORDS)
        return f"Spell the word {w} backwards.", f"{w[::-1]}"
    if kind == 4:
        w = _phrase(rng, 3)
        return f"Write this in upper case: {w}", w.upper()
    if kind == 5:
        xs = [rng.randint(0, 50) for _ in range(rng.randint(3, 6))]
        return f"Sort these numbers: {xs}", f"Sorted: {sorted(xs)}"
    name = rng.choice(["square", "double", "negate", "halve", "increment"])
    body = {"square": "x * x", "double": "2 * x", "negate": "-x", "halve": "x / 2", "increment": "x + 1"}[name]
    return (f"Write a Python function named {name} that takes x.",
            f"```python\ndef {name}(x):\n    return {body}\n```")


def plain_turns(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        q, a = plain_qa(rng)
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return out


def chat_dialogue(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    return messages + plain_turns(rng, rng.randint(1, 3))


def dialogues(seed: int, n: int, tool_frac: float = 0.6) -> list[str]:
    """`n` rendered dialogues (each a complete conversation text), `tool_frac` of them with tools."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        if rng.random() < tool_frac:
            messages, tools = tool_dialogue(rng)
            texts.append(render(messages, tools))
        else:
            texts.append(render(chat_dialogue(rng)))
    return texts
