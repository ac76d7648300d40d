"""Tools and structured output (chat requests) -> a `Constraint`, or an OpenAIError.

    tools, tool_choice "auto" (the default with tools)  -> TOOLS_AUTO
    tool_choice "required"                               -> TOOLS_REQUIRED
    tool_choice {"type": "function", "function": {...}}  -> TOOL_NAMED (tool_name)
    tool_choice "none"                                   -> NONE (tools still in the prompt)
    response_format json_object / json_schema            -> JSON_OBJECT / JSON_SCHEMA
    parallel_tool_calls                                  -> Constraint.parallel_tool_calls

`tools` and `json_schema` travel as compact JSON text (no spaces, only the fields we know,
keys in the client's order: NOT sorted, because xgrammar generates an object's properties
in schema order, and sorting would force arguments into alphabetical order, unlike the
declared order the prompt shows and OpenAI / vLLM produce). Every
constraint is built with `build_grammar` here (cached), so a schema the engine cannot
enforce is a 400 naming it, never a failure further down. Refused combinations (400):
response_format with tools unless tool_choice is "none" (one grammar cannot be both a JSON
document and a tool call), "required" / a named tool without tools, a named tool not in
tools. The deprecated `functions` / `function_call` are refused by name (not mapped: their
answers would have to use the deprecated `function_call` message field too).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import msgspec

from shared.contracts.constraint import Constraint, ConstraintKind

from .limits import MAX_SCHEMA_CHARS, MAX_TOOLS, MAX_TOOLS_CHARS, SchemaBudget
from .protocol import ChatCompletionRequest, OpenAIError

log = logging.getLogger("pdmesh.gateway")

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")    # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
_CANON = dict(separators=(",", ":"))   # key order kept: it is the generated property order
TOOL_KINDS = (ConstraintKind.TOOLS_AUTO, ConstraintKind.TOOLS_REQUIRED, ConstraintKind.TOOL_NAMED)


def tools_and_format(req: ChatCompletionRequest, tool_format: str = "hermes"
                     ) -> tuple[list[dict] | None, Constraint]:
    """(tools for the chat template or None, the constraint); 400 for what cannot be served.
    tool_format: how the model writes tool calls (shared/toolformats.py)."""
    fmt_name = "" if tool_format == "hermes" else tool_format
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise OpenAIError(400, f"'{name}' is not supported; it is the deprecated form of "
                                   f"'{'tools' if name == 'functions' else 'tool_choice'}': send "
                                   f"'tools' and 'tool_choice' instead", name)
    budget = SchemaBudget()           # every schema of the request, together
    tools = openai_tools(req.tools, budget)
    kind, tool_name = _tool_choice(req.tool_choice, tools)
    fmt = _response_format(req.response_format, budget)
    if tools:
        # every tool must compile, whatever tool_choice says (they are all in the prompt)
        _check_grammar(Constraint(kind=ConstraintKind.TOOLS_AUTO, tools=_canonical(tools),
                                  tool_format=fmt_name), "tools")
    if fmt is not None and kind is not ConstraintKind.NONE:
        forced = ("tool_choice 'required'" if kind is ConstraintKind.TOOLS_REQUIRED else
                  f"tool_choice naming '{tool_name}'" if kind is ConstraintKind.TOOL_NAMED else
                  "tools with tool_choice 'auto'")
        raise OpenAIError(400, f"'response_format' of type '{fmt.kind.value}' cannot be combined "
                               f"with {forced}: the output cannot be both a JSON document and a "
                               f"tool call. Drop 'response_format', or set 'tool_choice' to "
                               f"'none' to get JSON with the tools only described in the prompt",
                          "response_format")
    if fmt is not None:
        constraint = fmt
        _check_grammar(constraint, "response_format.json_schema.schema"
                       if fmt.kind is ConstraintKind.JSON_SCHEMA else "response_format",
                       prefix=True)
    elif kind is ConstraintKind.NONE:
        constraint = Constraint()
    else:
        constraint = Constraint(kind=kind, tools=_canonical(tools), tool_name=tool_name,
                                parallel_tool_calls=req.parallel_tool_calls is not False,
                                tool_format=fmt_name)
        _check_grammar(constraint, "tool_choice" if tool_name else "tools")
    return tools, constraint


def openai_tools(tools, budget: SchemaBudget | None = None) -> list[dict] | None:
    """The tools list in OpenAI form, only the fields we know (what the template renders and
    the constraint carries); None when there are none."""
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}",
                          "tools")
    out: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if tool.type != "function":
            raise OpenAIError(400, f"'{p}.type' must be 'function', got {tool.type!r}",
                              f"{p}.type")
        fn = tool.function
        if not TOOL_NAME.fullmatch(fn.name):
            raise OpenAIError(400, f"'{p}.function.name' must be 1 to 64 characters of a-z, A-Z, "
                                   f"0-9, underscores and dashes; got {fn.name[:80]!r}",
                              f"{p}.function.name")
        if fn.name in seen:
            raise OpenAIError(400, f"tool name '{fn.name}' appears more than once in 'tools' "
                                   f"(tools[{seen[fn.name]}] and tools[{i}])", f"{p}.function.name")
        seen[fn.name] = i
        params = fn.parameters
        if params is not None:
            (budget or SchemaBudget()).check(params, f"{p}.function.parameters")
        if params is not None and params.get("type", "object") != "object":
            raise OpenAIError(400, f"'{p}.function.parameters' must be a JSON schema of type "
                                   f"'object', got type {params.get('type')!r}",
                              f"{p}.function.parameters")
        d: dict = {"name": fn.name}
        if fn.description is not None:
            d["description"] = fn.description
        if params is not None:
            d["parameters"] = params
        out.append({"type": "function", "function": d})
    return out


def _tool_choice(choice, tools: list[dict] | None) -> tuple[ConstraintKind, str | None]:
    if choice is None:
        return (ConstraintKind.TOOLS_AUTO if tools else ConstraintKind.NONE), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise OpenAIError(400, f"'tool_choice' must be 'none', 'auto', 'required' or "
                                   f'{{"type": "function", "function": {{"name": ...}}}}; got '
                                   f"{choice[:80]!r}", "tool_choice")
        if choice == "none":
            return ConstraintKind.NONE, None
        if not tools:
            if choice == "required":
                raise OpenAIError(400, "'tool_choice' is 'required' but no 'tools' were given",
                                  "tool_choice")
            return ConstraintKind.NONE, None          # "auto" with nothing to call
        return (ConstraintKind.TOOLS_REQUIRED if choice == "required"
                else ConstraintKind.TOOLS_AUTO), None
    if choice.type != "function":
        raise OpenAIError(400, f"'tool_choice.type' must be 'function', got {choice.type!r}",
                          "tool_choice.type")
    name = choice.function.name
    if not tools:
        raise OpenAIError(400, f"'tool_choice' names function {name[:80]!r} but no 'tools' were "
                               f"given", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise OpenAIError(400, f"'tool_choice' names function {name[:80]!r}, which is not in "
                               f"'tools' (tools: {', '.join(names[:20])}"
                               f"{', ...' if len(names) > 20 else ''})", "tool_choice")
    return ConstraintKind.TOOL_NAMED, name


def _response_format(rf, budget: SchemaBudget) -> Constraint | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(kind=ConstraintKind.JSON_OBJECT)
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise OpenAIError(400, "'response_format.json_schema' is required when "
                                   "'response_format.type' is 'json_schema'",
                              "response_format.json_schema")
        if rf.json_schema.schema_ is None:
            raise OpenAIError(400, "'response_format.json_schema.schema' is required: the JSON "
                                   "schema the output must follow",
                              "response_format.json_schema.schema")
        budget.check(rf.json_schema.schema_, "response_format.json_schema.schema")
        return Constraint(kind=ConstraintKind.JSON_SCHEMA,
                          json_schema=_canonical(rf.json_schema.schema_,
                                                 "response_format.json_schema.schema",
                                                 MAX_SCHEMA_CHARS))
    raise OpenAIError(400, f"'response_format.type' must be one of 'text', 'json_object', "
                           f"'json_schema'; got {rf.type[:80]!r}", "response_format.type")


def _canonical(obj, param: str = "tools", limit: int = MAX_TOOLS_CHARS) -> str:
    """Compact JSON text, at most `limit` characters (checked before anything is cached)."""
    try:
        text = json.dumps(obj, **_CANON)
    except (RecursionError, ValueError, TypeError) as e:
        raise OpenAIError(400, f"'{param}' cannot be used: {type(e).__name__}: {e}",
                          param) from None
    if len(text) > limit:
        raise OpenAIError(400, f"'{param}' is too large: {len(text)} characters of compact "
                               f"JSON, at most {limit}", param, code="schema_too_large")
    return text


@dataclass(frozen=True, slots=True)
class GrammarCheck:
    """A constraint whose grammar is still to be compiled (grammar_check.GrammarGuard)."""
    constraint: Constraint = field(repr=False)
    key: bytes                  # its digest: the verdict cache's key
    param: str
    prefix: bool


_deferred = threading.local()
_VERDICTS: OrderedDict[bytes, str | None] = OrderedDict()    # digest -> problem / None
_VERDICTS_MAX = 4096
_verdicts_lock = threading.Lock()


@contextmanager
def deferred_checks() -> Iterator[list[GrammarCheck]]:
    """Within it (on this thread), a grammar check no verdict answers is collected instead
    of run: the gateway compiles those off the parse thread, with a time limit."""
    _deferred.checks = pending = []
    try:
        yield pending
    finally:
        _deferred.checks = None


def constraint_key(c: Constraint) -> bytes:
    return hashlib.blake2b(msgspec.json.encode(c), digest_size=16).digest()


def verdict(key: bytes) -> str | None | bool:
    """The cached problem of a constraint (None: fine), or False when not known."""
    with _verdicts_lock:
        if key not in _VERDICTS:
            return False
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]


def remember(key: bytes, problem: str | None) -> None:
    with _verdicts_lock:
        _VERDICTS[key] = problem[:1000] if problem else None
        while len(_VERDICTS) > _VERDICTS_MAX:
            _VERDICTS.popitem(last=False)


TOO_COMPLEX = "schema too complex"        # grammar_check's verdict past its time limit


def grammar_error(check: GrammarCheck, problem: str) -> OpenAIError:
    code = "schema_too_complex" if problem.startswith(TOO_COMPLEX) else None
    return OpenAIError(400, f"'{check.param}' cannot be used: {problem}" if check.prefix
                       else problem, check.param, code=code)


def _check_grammar(c: Constraint, param: str, prefix: bool = False) -> None:
    """The constraint's verdict, cached by digest (never by its text); unknown: compiled
    later (deferred_checks) or built here (callers outside the gateway, tests)."""
    check = GrammarCheck(c, constraint_key(c), param, prefix)
    problem = verdict(check.key)
    if problem is False:
        pending = getattr(_deferred, "checks", None)
        if pending is not None:
            pending.append(check)
            return
        problem = grammar_problem(c)
        remember(check.key, problem)
    if problem is not None:
        raise grammar_error(check, problem)


def grammar_problem(c: Constraint, compile_=None) -> str | None:
    """What refuses this constraint, or None: build_grammar, then compile_(c) when given
    (a GrammarCompiler's: the whole work against the vocabulary)."""
    from shared.engine.grammar import ConstraintError, build_grammar
    from shared.engine.grammar.build import xgrammar_message
    try:
        build_grammar(c)
        if compile_ is not None:
            compile_(c)
    except ConstraintError as e:
        return str(e)
    except RecursionError:
        return "the schema is nested too deeply for constrained decoding"
    except Exception as e:  # noqa: BLE001 - xgrammar refusing in a way we did not foresee
        log.warning("grammar build failed unexpectedly for %s: %s", c.kind.value,
                    type(e).__name__)
        return f"the schema cannot be compiled for constrained decoding: {xgrammar_message(e)}"
    return None
