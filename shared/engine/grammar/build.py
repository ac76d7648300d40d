"""Constraint -> xgrammar `Grammar`: what the output must look like, independent of any tokenizer.

Pure and cheap (milliseconds), so the gateway can call `build_grammar` to refuse a bad schema
with a 400 before any engine sees it; the engine then compiles the same grammar against its
vocabulary (compiler.py).

Output formats, matching the chat templates so a constrained call renders back into the
history token for token (tool calls in the format the constraint names, toolformats.py):

    json_object     {"k": v, ...}                      any object, ", " and ": " separators
    json_schema     the schema's instance, same spacing (strict: no unlisted properties)
    tool call       hermes       <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>
                    llama3_json  {"name": "NAME", "parameters": ARGS}
                    mistral      [TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]
                    glm45        <tool_call>NAME\n then per property
                                 <arg_key>K</arg_key>\n<arg_value>V</arg_value>\n, then
                                 </tool_call>; properties in schema order, strings raw
    tools_required  call (SEP call)*    (exactly one call when parallel_tool_calls is false;
                    SEP "\n", Llama 3's "; ", Mistral's ", " inside one [...])
    tool_named      one call to that tool
    tools_auto      free text; the format's open marker in it starts a call, after which
                    text may go on (with parallel_tool_calls false, generation ends after
                    the first call)

JSON is generated without free whitespace (`any_whitespace=False`): small models otherwise
loop on spaces and newlines inside the object.
"""
from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr
from xgrammar import structural_tag as st

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.toolformats import get as tool_format

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
CALL_SEPARATOR = "\n"
MAX_SCHEMA_CHARS = 256 * 1024

# Keywords whose constraint the grammar cannot enforce: xgrammar accepts the schema but lets
# violating instances through, so "validates against the schema" would silently be false.
# Refused instead (the gateway answers 400 and names the keyword).
UNENFORCEABLE_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
})
_SHAPE_KEYS = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYS = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems",
                "contains", "propertyNames", "unevaluatedItems")
# xgrammar 0.2.9 spells a character of a length-bounded string (minLength / maxLength) as
# [^"\\\r\n], which lets raw control characters through (invalid JSON: json.loads refuses
# "a\x0cb"); plain strings use the right class. Patched in the printed grammar.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_XGR_LOCATION = re.compile(r"\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class ConstraintError(ValueError):
    """The constraint cannot be served (bad or unsupported schema, unknown tool, ...); the
    message says what is wrong and is safe to show the client (gateway -> HTTP 400)."""


def build_grammar(constraint: Constraint) -> xgr.Grammar | None:
    """The grammar the output must match; None for ConstraintKind.NONE."""
    kind = ConstraintKind(constraint.kind)
    if kind is ConstraintKind.NONE:
        return None
    if kind is ConstraintKind.JSON_OBJECT:
        return _json_grammar({"type": "object"}, strict=False)
    if kind is ConstraintKind.JSON_SCHEMA:
        return _json_grammar(_parse_schema(constraint.json_schema), strict=True)
    return _tools_grammar(constraint, kind)


def tool_parameters(tools_json: str | None) -> dict[str, dict]:
    """OpenAI tools list (JSON text) -> {name: parameters schema}, in the list's order."""
    try:
        tools = json.loads(tools_json) if tools_json else None
    except ValueError as e:
        raise ConstraintError(f"tools is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not tools:
        raise ConstraintError("tool calling needs a non-empty list of tools")
    params: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"tools[{i}] has no function name")
        if name in params:
            raise ConstraintError(f"tool name {name!r} appears more than once")
        schema = fn.get("parameters")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise ConstraintError(f"parameters of tool {name!r} must be a JSON schema object")
        if schema.get("type", "object") != "object":
            raise ConstraintError(f"parameters of tool {name!r} must describe an object")
        if "type" not in schema and not _SHAPE_KEYS & schema.keys():
            schema = {**schema, "type": "object"}      # {} would let "arguments": 3 through
        check_schema(schema, where=f"parameters of tool {name!r}")
        params[name] = schema
    return params


def check_schema(schema: Any, where: str = "schema") -> None:
    """Refuse schemas xgrammar would accept without enforcing (UNENFORCEABLE_KEYWORDS,
    uniqueItems, allOf with several branches)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where}: a JSON schema must be an object or a boolean")
    bad = sorted(UNENFORCEABLE_KEYWORDS & schema.keys())
    if bad:
        raise ConstraintError(f"{where}: JSON schema keyword {bad[0]!r} is not supported "
                              "by constrained decoding")
    if schema.get("uniqueItems") is True:
        raise ConstraintError(f"{where}: JSON schema keyword 'uniqueItems' is not supported "
                              "by constrained decoding")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ConstraintError(f"{where}: 'allOf' with more than one schema is not supported "
                              "by constrained decoding")
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}.{key}.{name}")
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}[{i}]")
    for key in _SCHEMA_KEYS:
        sub = schema.get(key)
        for i, s in enumerate(sub if isinstance(sub, list) else [sub] if sub is not None else []):
            check_schema(s, f"{where}.{key}" + (f"[{i}]" if isinstance(sub, list) else ""))


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    return _XGR_LOCATION.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else repr(e)


def _parse_schema(text: str | None) -> Any:
    if not text:
        raise ConstraintError("json_schema constraint without a schema")
    if len(text) > MAX_SCHEMA_CHARS:
        raise ConstraintError(f"JSON schema is larger than {MAX_SCHEMA_CHARS} characters")
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ConstraintError(f"JSON schema is not valid JSON: {e}") from None
    check_schema(schema)
    return schema


def _json_grammar(schema: Any, *, strict: bool, where: str = "JSON schema") -> xgr.Grammar:
    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=strict)
        ebnf = str(grammar)
        if _LOOSE_STRING_CHAR in ebnf:
            grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConstraintError(f"{where} is not supported: {xgrammar_message(e)}") from None
    return grammar


def _call_tag(name: str, schema: dict, style: str = "hermes") -> st.TagFormat:
    """One call to tool `name` in the format `style`, as a structural tag."""
    where = f"parameters of tool {name!r}"
    quoted = json.dumps(name, ensure_ascii=False)
    if style == "glm45":
        return st.TagFormat(begin=f"{TOOL_CALL_START}{name}\n", content=_glm_args(schema, where),
                            end=TOOL_CALL_END)
    args = st.GrammarFormat(grammar=str(_json_grammar(schema, strict=True, where=where)))
    if style == "llama3_json":
        return st.TagFormat(begin=f'{{"name": {quoted}, "parameters": ', content=args, end="}")
    if style == "mistral":
        return st.TagFormat(begin=f'{{"name": {quoted}, "arguments": ', content=args, end="}")
    return st.TagFormat(begin=f'{TOOL_CALL_START}\n{{"name": {quoted}, "arguments": ',
                        content=args, end=f"}}\n{TOOL_CALL_END}")


def _glm_args(schema: dict, where: str) -> st.SequenceFormat:
    """GLM's <arg_key>/<arg_value> pairs: each property in schema order (optional unless
    required), a string property's value raw (no "<"), any other as its JSON."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts: list[Any] = [st.ConstStringFormat(value="")]
    for key, sub in props.items():
        value = (st.RegexFormat(pattern=_raw_string(sub)) if sub.get("type") == "string" else
                 st.GrammarFormat(grammar=str(_json_grammar(sub, strict=True, where=where))))
        pair = st.SequenceFormat(elements=[
            st.ConstStringFormat(value=f"<arg_key>{key}</arg_key>\n<arg_value>"), value,
            st.ConstStringFormat(value="</arg_value>\n")])
        parts.append(pair if key in required else st.OptionalFormat(content=pair))
    return st.SequenceFormat(elements=parts)


def _raw_string(schema: dict) -> str:
    """A string property's value as GLM writes it (raw, up to the next tag): its enum, or
    any text without "<" within minLength..maxLength."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + "|".join(re.escape(v) for v in schema["enum"]) + ")"
    lo, hi = int(schema.get("minLength") or 0), schema.get("maxLength")
    return f"[^<]{{{lo},{int(hi)}}}" if hi is not None else f"[^<]{{{lo},}}"


SEPARATORS = {"hermes": CALL_SEPARATOR, "glm45": CALL_SEPARATOR, "llama3_json": "; ",
              "mistral": ", "}


def _tools_grammar(c: Constraint, kind: ConstraintKind) -> xgr.Grammar:
    params = tool_parameters(c.tools)
    try:
        style = tool_format(c.tool_format).name
    except ValueError as e:
        raise ConstraintError(str(e)) from None
    one = not c.parallel_tool_calls
    if kind is ConstraintKind.TOOL_NAMED:
        if c.tool_name not in params:
            raise ConstraintError(f"tool_choice names {c.tool_name!r}, which is not in tools")
        fmt: Any = _call_tag(c.tool_name, params[c.tool_name], style)
    else:
        tags = [_call_tag(name, schema, style) for name, schema in params.items()]
        if kind is ConstraintKind.TOOLS_REQUIRED:
            fmt = st.TagsWithSeparatorFormat(tags=tags, separator=SEPARATORS[style],
                                             at_least_one=True, stop_after_first=one)
        elif kind is ConstraintKind.TOOLS_AUTO and style == "mistral":
            fmt = st.TriggeredTagsFormat(triggers=["[TOOL_CALLS]"], tags=[
                st.TagFormat(begin="[TOOL_CALLS][" + t.begin, content=t.content, end=t.end + "]")
                for t in tags], stop_after_first=one)
        elif kind is ConstraintKind.TOOLS_AUTO:
            trigger = '{"name": ' if style == "llama3_json" else TOOL_CALL_START
            fmt = st.TriggeredTagsFormat(triggers=[trigger], tags=tags, stop_after_first=one)
        else:
            raise ConstraintError(f"unknown constraint kind {kind!r}")
    if style == "mistral" and kind is not ConstraintKind.TOOLS_AUTO:   # one [...] block
        fmt = st.SequenceFormat(elements=[st.ConstStringFormat(value="[TOOL_CALLS]["), fmt,
                                          st.ConstStringFormat(value="]")])
    try:
        return xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConstraintError(f"tools cannot be compiled: {xgrammar_message(e)}") from None
