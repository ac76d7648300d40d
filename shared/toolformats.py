"""The tool-call formats model families speak, as text: how a call block opens and closes,
and what its body holds. Pure (no I/O); toolcalls.py parses a model's output with one,
grammar/build.py constrains generation to it, and `detect` picks one from a chat template.

    hermes       <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>  (Qwen 2.5/3,
                 Hermes, SmolLM2 with the bundled template)
    llama3_json  {"name": N, "parameters": {...}}  the whole output, optionally after
                 <|python_tag|>; several calls separated by "; "  (Llama 3.1-3.3)
    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}, ...]  to the end of the output
                 (Mistral v3 tokenizers); the v11 form [TOOL_CALLS]N[ARGS]{...} is read too
    glm45        <tool_call>N\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>
                 (GLM-4.5 and later: strings raw, other values as JSON)

vLLM's and SGLang's parsers of the same names read the same text. A marker a tokenizer
holds as a special token ([TOOL_CALLS], <|python_tag|>) reaches the parser only when the
detokenizer keeps special tokens' text (tokenizer.py keeps these)."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Call = tuple[str, str]      # (name, arguments as JSON text)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]     # markers that open a call block
    end: str | None             # closes it; None: the block runs to the end of the output
    parse: Callable[[str, Mapping[str, dict]], list[Call] | None]   # body -> calls or None
    leading: bool = False       # a block only opens the output (whitespace aside)
    keep_start: bool = False    # the marker is part of the body (Llama 3's "{")


def _args(obj: Any, key: str = "arguments") -> str | None:
    args = obj.get(key, obj.get("parameters" if key == "arguments" else "arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _call(obj: Any, key: str = "arguments") -> Call | None:
    """A JSON object with a non-empty string "name" and an object of arguments (missing:
    {}; a JSON string holding an object is accepted), or None."""
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), _args(obj, key)
    if not isinstance(name, str) or not name or args is None:
        return None
    return name, args


def _hermes(body: str, _tools) -> list[Call] | None:
    try:
        call = _call(json.loads(body))
    except ValueError:
        return None
    return [call] if call else None


def _llama3(body: str, _tools) -> list[Call] | None:
    body = body.strip().removeprefix("<|python_tag|>").strip()
    calls, dec, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, pos = dec.raw_decode(body, pos)
        except ValueError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        pos = len(body) - len(rest)
    return calls or None


V11 = re.compile(r"\s*([A-Za-z0-9_-]+)\[ARGS\]")


def _mistral(body: str, _tools) -> list[Call] | None:
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        part = part.strip()
        if not part:
            continue
        if m := V11.match(part):                      # name[ARGS]{...}
            try:
                args = json.loads(part[m.end():])
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append((m.group(1), json.dumps(args, ensure_ascii=False)))
            continue
        try:
            objs = json.loads(part)
        except ValueError:
            return None
        for obj in objs if isinstance(objs, list) else [objs]:
            call = _call(obj)
            if call is None:
                return None
            calls.append(call)
    return calls or None


GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def _glm45(body: str, tools: Mapping[str, dict]) -> list[Call] | None:
    head, _, _ = body.partition("<arg_key>")
    name = head.strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        return None
    rest = body[len(head):]
    props = (tools.get(name) or {}).get("properties") or {}
    args, pos = {}, 0
    for m in GLM_PAIR.finditer(rest):
        if m.start() != pos:
            return None
        key, raw = m.group(1).strip(), m.group(2)
        if (props.get(key) or {}).get("type") == "string":
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        pos = m.end()
    if rest[pos:].strip():
        return None
    return [(name, json.dumps(args, ensure_ascii=False))]


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", ("<tool_call>",), "</tool_call>", _hermes),
    ToolFormat("llama3_json", ("<|python_tag|>", "{"), None, _llama3, leading=True,
               keep_start=True),
    ToolFormat("mistral", ("[TOOL_CALLS]",), None, _mistral, keep_start=True),
    ToolFormat("glm45", ("<tool_call>",), "</tool_call>", _glm45),
)}
DEFAULT = "hermes"
# every marker text a format reads: a tokenizer holding one as a special token must still
# decode it (tokenizer.py)
MARKERS = frozenset({m for f in FORMATS.values() for m in (*f.starts, f.end) if m and m != "{"}
                    | {"[ARGS]", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"})


def detect(chat_template: str | None) -> str:
    """The format a chat template renders tool calls in (as the model was trained to
    write them); hermes when it says nothing (the bundled tool template is Hermes)."""
    t = chat_template or ""
    if "<arg_key>" in t:
        return "glm45"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return DEFAULT


def get(name: str | None) -> ToolFormat:
    if not name:
        return FORMATS[DEFAULT]
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None
