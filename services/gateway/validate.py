"""Request body -> (prompt ids, SamplingParams, Constraint, Options), or an OpenAIError.

Pure: no I/O and no randomness (the seed, when the client gave none, is drawn at dispatch).
Cheap checks run before the chat template is rendered and the prompt tokenized. Every
error names the offending parameter, in the message and in `param`.

Tools and structured output are turned into a `Constraint` by structured.py.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import msgspec

from shared.contracts.constraint import Constraint
from shared.contracts.sampling import SamplingParams

from .limits import check_cache_salt, check_logit_bias, check_stop, check_text_budget, text_chars
from .model import ModelSpec
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAIError
from .structured import TOOL_KINDS, tools_and_format

log = logging.getLogger("pdmesh.gateway")

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
COMPLETION_DEFAULT_MAX_TOKENS = 16
SEED_RANGE = (-(1 << 63), 1 << 64)
MAX_N = 16                 # choices per request (n); each is a generation of its own


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
    cache_salt: str | None = None          # the body's own (vLLM's); see auth.cache_salt
    n: int = 1                             # choices (chat and completions; choices.py)


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams  # seed may still be None: resolved at dispatch
    constraint: Constraint
    options: Options


# ---- entry points ------------------------------------------------------------------------


def parse_chat(body: bytes, spec: ModelSpec) -> Prepared:
    return prepare_chat(decode_body(body, ChatCompletionRequest), spec)


def prepare_chat(req: ChatCompletionRequest, spec: ModelSpec) -> Prepared:
    """A decoded chat request -> Prepared (the Responses and Messages APIs translate their
    bodies into one, apis/)."""
    check_model(req.model, spec)
    _check_common(req)
    tools, constraint = tools_and_format(req, spec.tool_format)
    messages = [message_dict(i, m) for i, m in enumerate(req.messages)] if req.messages else None
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

    check_text_budget(text_chars(messages) + text_chars(tools), spec, "messages")
    try:
        prompt_ids = spec.tokenizer.encode_chat(messages, tools=tools)
    except template_errors() as e:
        raise OpenAIError(400, f"the chat template cannot render these messages: {e}",
                          "messages") from e
    max_tokens = fit_context(len(prompt_ids), requested, spec.max_model_len, "messages", max_param,
                              cap=spec.default_max_tokens)
    params = _final(params, max_tokens, spec, max_param, chat=True)
    parse_calls = constraint.kind in TOOL_KINDS
    return Prepared(prompt_ids, params, constraint,
                    _options(req, spec, chat=True, logprobs=logprobs is not None,
                             tool_calls=parse_calls))


def parse_completion(body: bytes, spec: ModelSpec) -> Prepared:
    req = decode_body(body, CompletionRequest)
    check_model(req.model, spec)
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
        check_text_budget(len(text), spec, "prompt")
        ids = spec.tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise OpenAIError(400, "'prompt' encodes to no tokens", "prompt")
    bad = [t for t in ids if not 0 <= t < spec.vocab_size]
    if bad:
        raise OpenAIError(400, f"prompt token ids out of range [0, {spec.vocab_size}): {bad[:5]}",
                          "prompt")
    max_tokens = fit_context(len(ids), requested, spec.max_model_len, "prompt", "max_tokens")
    params = _final(params, max_tokens, spec, "max_tokens", chat=False)
    return Prepared(ids, params, Constraint(), _options(req, spec, chat=False,
                                                         logprobs=req.logprobs is not None))


# ---- body --------------------------------------------------------------------------------

_AT = re.compile(r" - at `\$(.*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def decode_body(body: bytes, typ: type):
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


def check_model(model: str | None, spec: ModelSpec) -> None:
    if not spec.accepts(model):
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                               f"`{spec.name}`.", "model", code="model_not_found")


def _check_common(req) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise OpenAIError(400, f"'n' must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    check_stop(req.stop, req.stop_token_ids)
    check_logit_bias(req.logit_bias)
    check_cache_salt(req.cache_salt)
    if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
        raise OpenAIError(400, f"'seed' must fit in 64 bits, got {req.seed}", "seed")


# ---- chat messages -----------------------------------------------------------------------


def message_dict(i: int, m: ChatMessage) -> dict:
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


def template_errors() -> tuple[type[Exception], ...]:
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
    d = spec.sampling_defaults      # the model's generation_config.json (defaults.py)
    top_k = _or(req.top_k, d.get("top_k", 0))
    top_k = 0 if top_k == -1 else top_k                        # vLLM spells "off" as -1
    params = SamplingParams(
        temperature=_or(req.temperature, d.get("temperature", 1.0)),
        top_p=_or(req.top_p, d.get("top_p", 1.0)), top_k=top_k,
        min_p=_or(req.min_p, d.get("min_p", 0.0)),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
        logit_bias=bias, seed=req.seed,
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


def fit_context(n_prompt: int, requested: int | None, window: int, prompt_name: str,
                 max_param: str, cap: int | None = None) -> int:
    """max_tokens for the request: as asked if it fits the window, else a 400 with the numbers
    (vLLM's wording); chat's default is whatever the window leaves, at most `cap`
    (GatewayConfig.default_max_tokens or the model's max_new_tokens)."""
    if requested is None:
        if n_prompt >= window:
            raise OpenAIError(400, f"This model's maximum context length is {window} tokens. "
                                   f"However, your {prompt_name} resulted in {n_prompt} tokens, "
                                   f"leaving no room for a completion. Please reduce the length "
                                   f"of the {prompt_name}.", prompt_name,
                              code="context_length_exceeded")
        return min(window - n_prompt, cap) if cap else window - n_prompt
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
        raise OpenAIError(400, "'pdmesh_path' must be 'pd' or 'colocated', "
                          f"got {req.pdmesh_path!r}", "pdmesh_path")
    return Options(chat=chat, model=spec.name, stream=stream, include_usage=include_usage,
                   logprobs=logprobs, return_token_ids=bool(req.return_token_ids),
                   force_path=req.pdmesh_path, tool_calls=tool_calls,
                   cache_salt=req.cache_salt, n=req.n or 1)


def _or(value, default):
    return default if value is None else value
