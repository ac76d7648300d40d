"""Request body -> (prompt ids, SamplingParams, Constraint, Options), or an OpenAIError.

Pure: no I/O and no randomness (the seed, when the client gave none, is drawn at dispatch).
Cheap checks run before the chat template is rendered and the prompt tokenized. Every
error names the offending parameter, in the message and in `param`.

Tools and structured output (chat only) become a `Constraint`:

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

import json
import logging
import re
from dataclasses import dataclass
from functools import lru_cache

import msgspec

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.contracts.sampling import SamplingParams

from .model import ModelSpec
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAIError

log = logging.getLogger("pdmesh.gateway")

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128                                   # OpenAI's limit
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")    # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
# JSON nesting of one schema document (~30 levels of nested objects): xgrammar's compile time
# grows fast with depth (seconds at ~150 levels), and the gateway compiles every schema
MAX_SCHEMA_DEPTH = 64
_CANON = dict(separators=(",", ":"))   # key order kept: it is the generated property order
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
COMPLETION_DEFAULT_MAX_TOKENS = 16
SEED_RANGE = (-(1 << 63), 1 << 64)


@dataclass(frozen=True, slots=True)
class Options:
    """How to answer (everything about a request that does not change its tokens)."""
    chat: bool
    model: str              # echoed in responses
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    force_path: str | None = None          # "pd" | "colocated"
    tool_calls: bool = False               # parse the output into tool_calls (chat, tools on)


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams  # seed may still be None: resolved at dispatch
    constraint: Constraint
    options: Options


# ---- entry points ------------------------------------------------------------------------


def parse_chat(body: bytes, spec: ModelSpec) -> Prepared:
    req = _decode(body, ChatCompletionRequest)
    _check_model(req.model, spec)
    _check_common(req)
    tools, constraint = _tools_and_format(req)
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)] if req.messages else None
    if not messages:
        raise OpenAIError(400, "'messages' must contain at least one message", "messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise OpenAIError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(400, f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got "
                                   f"{req.top_logprobs}", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    params = _sampling(req, spec, requested, max_param, logprobs, chat=True)

    try:
        prompt_ids = spec.tokenizer.encode_chat(messages, tools=tools)
    except _template_errors() as e:
        raise OpenAIError(400, f"the chat template cannot render these messages: {e}",
                          "messages") from e
    max_tokens = _fit_context(len(prompt_ids), requested, spec.max_model_len, "messages", max_param)
    params = _final(params, max_tokens, spec, max_param, chat=True)
    parse_calls = constraint.kind in _TOOL_KINDS
    return Prepared(prompt_ids, params, constraint,
                    _options(req, spec, chat=True, logprobs=logprobs is not None,
                             tool_calls=parse_calls))


def parse_completion(body: bytes, spec: ModelSpec) -> Prepared:
    req = _decode(body, CompletionRequest)
    _check_model(req.model, spec)
    _check_common(req)
    if req.echo:
        raise OpenAIError(400, "'echo' is not supported", "echo")
    if req.suffix:
        raise OpenAIError(400, "'suffix' is not supported", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise OpenAIError(400, f"'best_of' must be 1 (only one completion per request is "
                               f"supported), got {req.best_of}", "best_of")
    requested = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    params = _sampling(req, spec, requested, "max_tokens", req.logprobs, chat=False)

    text, ids = _prompt(req.prompt)
    if text is not None:
        ids = spec.tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise OpenAIError(400, "'prompt' encodes to no tokens", "prompt")
    bad = [t for t in ids if not 0 <= t < spec.vocab_size]
    if bad:
        raise OpenAIError(400, f"prompt token ids out of range [0, {spec.vocab_size}): {bad[:5]}",
                          "prompt")
    max_tokens = _fit_context(len(ids), requested, spec.max_model_len, "prompt", "max_tokens")
    params = _final(params, max_tokens, spec, "max_tokens", chat=False)
    return Prepared(ids, params, Constraint(), _options(req, spec, chat=False,
                                                         logprobs=req.logprobs is not None))


# ---- body --------------------------------------------------------------------------------

_AT = re.compile(r" - at `\$(.*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def _decode(body: bytes, typ: type):
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise _type_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None


def _type_error(msg: str) -> OpenAIError:
    m = _AT.search(msg)
    path = m.group(1).lstrip(".") if m else ""
    text = msg[:m.start()] if m else msg
    missing = _MISSING.match(text)
    if missing:
        param = f"{path}.{missing[1]}" if path else missing[1]
        return OpenAIError(400, f"'{param}' is a required property", param)
    if not path:
        return OpenAIError(400, f"request body must be a JSON object ({text})")
    return OpenAIError(400, f"Invalid type for '{path}': {text}", path)


def _check_model(model: str | None, spec: ModelSpec) -> None:
    if not spec.accepts(model):
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                               f"`{spec.name}`.", "model", code="model_not_found")


def _check_common(req) -> None:
    if req.n is not None and req.n != 1:
        raise OpenAIError(400, f"'n' must be 1 (only one choice per request is supported), "
                               f"got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise OpenAIError(400, f"'stop' may hold at most {MAX_STOP} sequences, got "
                               f"{len(req.stop)}", "stop")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
        raise OpenAIError(400, f"'seed' must fit in 64 bits, got {req.seed}", "seed")


_TOOL_KINDS = (ConstraintKind.TOOLS_AUTO, ConstraintKind.TOOLS_REQUIRED, ConstraintKind.TOOL_NAMED)


def _tools_and_format(req: ChatCompletionRequest) -> tuple[list[dict] | None, Constraint]:
    """(tools for the chat template or None, the constraint); 400 for what cannot be served."""
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise OpenAIError(400, f"'{name}' is not supported; it is the deprecated form of "
                                   f"'{'tools' if name == 'functions' else 'tool_choice'}': send "
                                   f"'tools' and 'tool_choice' instead", name)
    tools = _tools(req.tools)
    kind, tool_name = _tool_choice(req.tool_choice, tools)
    fmt = _response_format(req.response_format)
    if tools:
        # every tool must compile, whatever tool_choice says (they are all in the prompt)
        _check_grammar(Constraint(kind=ConstraintKind.TOOLS_AUTO, tools=_canonical(tools)),
                       "tools")
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
                                parallel_tool_calls=req.parallel_tool_calls is not False)
        _check_grammar(constraint, "tool_choice" if tool_name else "tools")
    return tools, constraint


def _tools(tools) -> list[dict] | None:
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
            _check_depth(params, f"{p}.function.parameters")
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


def _response_format(rf) -> Constraint | None:
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
        _check_depth(rf.json_schema.schema_, "response_format.json_schema.schema")
        return Constraint(kind=ConstraintKind.JSON_SCHEMA,
                          json_schema=_canonical(rf.json_schema.schema_,
                                                 "response_format.json_schema.schema"))
    raise OpenAIError(400, f"'response_format.type' must be one of 'text', 'json_object', "
                           f"'json_schema'; got {rf.type[:80]!r}", "response_format.type")


def _check_depth(schema, param: str) -> None:
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise OpenAIError(400, f"'{param}' is nested too deeply: more than "
                                   f"{MAX_SCHEMA_DEPTH} levels of JSON", param)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _canonical(obj, param: str = "tools") -> str:
    try:
        return json.dumps(obj, **_CANON)
    except (RecursionError, ValueError, TypeError) as e:
        raise OpenAIError(400, f"'{param}' cannot be used: {type(e).__name__}: {e}",
                          param) from None


def _check_grammar(c: Constraint, param: str, prefix: bool = False) -> None:
    problem = _grammar_problem(c)
    if problem is not None:
        raise OpenAIError(400, f"'{param}' cannot be used: {problem}" if prefix else problem,
                          param)


@lru_cache(maxsize=512)
def _grammar_problem(c: Constraint) -> str | None:
    """What build_grammar refuses in this constraint, or None (cached per constraint)."""
    from shared.engine.grammar import ConstraintError, build_grammar
    try:
        build_grammar(c)
    except ConstraintError as e:
        return str(e)
    except RecursionError:
        return "the schema is nested too deeply for constrained decoding"
    except Exception as e:  # noqa: BLE001 - xgrammar refusing in a way we did not foresee
        log.warning("grammar build failed unexpectedly for %s: %r", c.kind.value, e)
        return f"the schema cannot be compiled for constrained decoding: {e}"
    return None


# ---- chat messages -----------------------------------------------------------------------


def _message_dict(i: int, m: ChatMessage) -> dict:
    p = f"messages[{i}]"
    if m.role not in ROLES:
        raise OpenAIError(400, f"'{p}.role' must be one of 'system', 'user', 'assistant', "
                               f"'tool'; got '{m.role}'", f"{p}.role")
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise OpenAIError(400, f"'{p}.content[{j}]' has type '{part.type}'; only 'text' "
                                       f"content parts are supported", f"{p}.content[{j}].type")
            if part.text is None:
                raise OpenAIError(400, f"'{p}.content[{j}].text' is a required property",
                                  f"{p}.content[{j}].text")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None and not (m.role == "assistant" and m.tool_calls):
        raise OpenAIError(400, f"'{p}.content' is required for a '{m.role}' message",
                          f"{p}.content")
    if m.tool_calls and m.role != "assistant":
        raise OpenAIError(400, f"'{p}.tool_calls' is only allowed in 'assistant' messages, not "
                               f"'{m.role}'", f"{p}.tool_calls")
    if m.role == "tool" and not m.tool_call_id:
        raise OpenAIError(400, f"'{p}.tool_call_id' is required for a 'tool' message (the id of "
                               f"the call it answers)", f"{p}.tool_call_id")
    out: dict = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [_call_dict(f"{p}.tool_calls[{j}]", c)
                             for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def _call_dict(p: str, call) -> dict:
    """An assistant tool call as the templates render it. Arguments that are a JSON object
    (as text or as an object) are passed as a mapping, so the template writes them the way
    a generated call is written (json.dumps spacing) and a replayed history repeats the
    generated tokens; any other string is rendered as given."""
    if call.type != "function":
        raise OpenAIError(400, f"'{p}.type' must be 'function', got {call.type!r}", f"{p}.type")
    fn = call.function
    if not fn.name:
        raise OpenAIError(400, f"'{p}.function.name' must not be empty", f"{p}.function.name")
    args = fn.arguments
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    out: dict = {"type": "function", "function": {"name": fn.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _template_errors() -> tuple[type[Exception], ...]:
    """What rendering a client's messages and tools may raise: the client's doing, a 400."""
    from jinja2 import TemplateError
    return (TemplateError, RecursionError, TypeError, ValueError)


# ---- completions prompt ------------------------------------------------------------------


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt(prompt) -> tuple[str | None, list[int]]:
    """(text, []) or (None, token ids)."""
    if prompt is None:
        raise OpenAIError(400, "'prompt' is a required property", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, "'prompt' must not be empty", "prompt")
        return prompt, []
    if isinstance(prompt, list):
        if not prompt:
            raise OpenAIError(400, "'prompt' must not be empty", "prompt")
        if all(_is_id(x) for x in prompt):
            return None, list(prompt)
        if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
            if len(prompt) > 1:
                raise OpenAIError(400, f"batch prompts (a list of {len(prompt)} prompts) are not "
                                       f"supported; send one prompt per request", "prompt")
            return _prompt(prompt[0])
    raise OpenAIError(400, "'prompt' must be a string, a list of token ids, or a list holding "
                           "one of those", "prompt")


# ---- sampling ----------------------------------------------------------------------------


def _sampling(req, spec: ModelSpec, requested: int | None, max_param: str,
              logprobs: int | None, chat: bool) -> SamplingParams:
    if requested is not None and requested < 1:
        raise OpenAIError(400, f"'{max_param}' must be at least 1, got {requested}", max_param)
    bias = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise OpenAIError(400, f"'logit_bias' keys must be token ids (strings of "
                                       f"integers), got {key!r}", "logit_bias") from None
            if not 0 <= tok < spec.vocab_size:
                raise OpenAIError(400, f"'logit_bias' token id {tok} is out of range "
                                       f"[0, {spec.vocab_size})", "logit_bias")
            bias[tok] = value
    stop_ids = tuple(req.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < spec.vocab_size]
    if bad:
        raise OpenAIError(400, f"'stop_token_ids' out of range [0, {spec.vocab_size}): {bad[:5]}",
                          "stop_token_ids")
    top_k = req.top_k if req.top_k not in (None, -1) else 0   # vLLM spells "off" as -1
    params = SamplingParams(
        temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=top_k,
        min_p=_or(req.min_p, 0.0), presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0), logit_bias=bias, seed=req.seed,
        max_tokens=requested if requested is not None else spec.max_model_len,
        min_tokens=_or(req.min_tokens, 0),
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output), logprobs=logprobs)
    _check(params, spec, max_param, chat)
    return params


def _final(params: SamplingParams, max_tokens: int, spec: ModelSpec, max_param: str,
           chat: bool) -> SamplingParams:
    if max_tokens != params.max_tokens:
        params = msgspec.structs.replace(params, max_tokens=max_tokens)
        _check(params, spec, max_param, chat)
    return params


def _check(params: SamplingParams, spec: ModelSpec, max_param: str, chat: bool) -> None:
    try:
        params.check(spec.vocab_size)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = {"max_tokens": max_param, "logprobs": "top_logprobs" if chat else "logprobs",
                 "token": None}.get(field, field)
        raise OpenAIError(400, str(e), param) from None


def _fit_context(n_prompt: int, requested: int | None, window: int, prompt_name: str,
                 max_param: str) -> int:
    """max_tokens for the request: as asked if it fits the window, else a 400 with the numbers
    (vLLM's wording); chat's default is whatever the window leaves."""
    if requested is None:
        if n_prompt >= window:
            raise OpenAIError(400, f"This model's maximum context length is {window} tokens. "
                                   f"However, your {prompt_name} resulted in {n_prompt} tokens, "
                                   f"leaving no room for a completion. Please reduce the length "
                                   f"of the {prompt_name}.", prompt_name,
                              code="context_length_exceeded")
        return window - n_prompt
    if n_prompt + requested > window:
        raise OpenAIError(400, f"This model's maximum context length is {window} tokens. However, "
                               f"you requested {n_prompt + requested} tokens ({n_prompt} in the "
                               f"{prompt_name}, {requested} in the completion). Please reduce the "
                               f"length of the {prompt_name} or completion.",
                          max_param if n_prompt < window else prompt_name,
                          code="context_length_exceeded")
    return requested


def _options(req, spec: ModelSpec, chat: bool, logprobs: bool,
             tool_calls: bool = False) -> Options:
    stream = bool(req.stream)
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)
    if req.pdmesh_path not in (None, "pd", "colocated"):
        raise OpenAIError(400, f"'pdmesh_path' must be 'pd' or 'colocated', got {req.pdmesh_path!r}",
                          "pdmesh_path")
    return Options(chat=chat, model=spec.name, stream=stream, include_usage=include_usage,
                   logprobs=logprobs, return_token_ids=bool(req.return_token_ids),
                   force_path=req.pdmesh_path, tool_calls=tool_calls)


def _or(value, default):
    return default if value is None else value
