"""OpenAI Responses API request -> a chat request -> `Job` (validate.prepare_chat).

    instructions                      -> a system message first (not carried over by
                                         previous_response_id, as OpenAI does)
    input: "text"                     -> one user message
    input items: {role, content}      -> messages (input_text / output_text parts)
      {type: function_call}           -> the assistant message's tool_calls
      {type: function_call_output}    -> a tool message (tool_call_id = call_id)
      {type: reasoning}               -> skipped (this server emits none)
    previous_response_id              -> that response's conversation first (store.py)
    tools [{type: function, name,..}] -> tools; tool_choice auto / required / none /
                                         {type: function, name} -> the same Constraint as
                                         chat's (structured.py), so it crosses PD
    text.format json_schema / json_object -> response_format
    max_output_tokens                 -> max_completion_tokens
    metadata                          -> echoed and stored as given, within OpenAI's
                                         bounds: 16 pairs, keys of 64 characters, string
                                         values of 512 (stored per response: store.py)

Errors are OpenAI errors whose `param` names the Responses field (input, text.format, ...).
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from .. import protocol as P
from ..model import ModelSpec
from ..protocol import OpenAIError
from ..validate import decode_body, prepare_chat
from .common import Job

UNSUPPORTED = ("background", "conversation", "prompt")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64             # characters
MAX_METADATA_VALUE = 512          # characters


class Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class Item(msgspec.Struct, kw_only=True):
    type: str | None = None
    role: str | None = None
    content: str | list[Part] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    status: str | None = None


class RTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class RToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class Format(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: Format | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Item] | None = None
    instructions: str | None = None
    tools: list[RTool] | None = None
    tool_choice: str | RToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None      # checked by _check_metadata
    user: str | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM-style extras and pdmesh's placement switch
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    pdmesh_path: str | None = None


class Ctx(msgspec.Struct, kw_only=True):
    """What the answer echoes and what `store` keeps."""
    req: ResponsesRequest
    history: list[P.ChatMessage]     # the conversation so far, without instructions
    store: bool


def parse_responses(body: bytes, spec: ModelSpec, lookup) -> Job:
    """`lookup(previous_response_id)` -> that response's history (list of ChatMessage) or
    None (store.py)."""
    req = decode_body(body, ResponsesRequest)
    _refuse(req)
    history: list[P.ChatMessage] = []
    if req.previous_response_id is not None:
        found = lookup(req.previous_response_id)
        if found is None:
            raise OpenAIError(404, f"Previous response with id '{req.previous_response_id}' "
                                   f"not found (responses are kept only with store: true, in "
                                   f"a bounded in-memory store)", "previous_response_id",
                              code="previous_response_not_found")
        history = list(found)
    history += _input_messages(req.input)
    system = [P.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    chat = P.ChatCompletionRequest(
        model=req.model, messages=system + history, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty, stop=req.stop,
        tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_format(req.text),
        pdmesh_path=req.pdmesh_path, user=req.user)
    try:
        prep = prepare_chat(chat, spec)
    except OpenAIError as e:
        raise _renamed(e) from None
    return Job(prep, bool(req.stream), Ctx(req=req, history=history,
                                           store=req.store is not False))


def _refuse(req: ResponsesRequest) -> None:
    for name in UNSUPPORTED:
        if getattr(req, name) not in (None, False):
            raise OpenAIError(400, f"'{name}' is not supported by this server", name)
    if req.input is None or req.input == "" or req.input == []:
        raise OpenAIError(400, "'input' is required: a string or a list of input items",
                          "input")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise OpenAIError(400, f"'max_output_tokens' must be at least 1, got "
                               f"{req.max_output_tokens}", "max_output_tokens")
    if req.top_logprobs:
        raise OpenAIError(400, "'top_logprobs' is not supported on /v1/responses",
                          "top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise OpenAIError(400, f"'truncation' must be 'disabled' (this server never drops "
                               f"input), got {req.truncation!r}", "truncation")
    _check_metadata(req.metadata)


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise OpenAIError(400, f"'metadata' may hold at most {MAX_METADATA_PAIRS} key-value "
                               f"pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise OpenAIError(400, f"'metadata' keys must be at most {MAX_METADATA_KEY} "
                                   f"characters, got one of {len(key)}", "metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise OpenAIError(400, f"'metadata' values must be strings of at most "
                                   f"{MAX_METADATA_VALUE} characters; the value of "
                                   f"{key!r} is not", "metadata")


# ---- input items -------------------------------------------------------------------------


def _input_messages(inp: str | list[Item] | None) -> list[P.ChatMessage]:
    if isinstance(inp, str):
        return [P.ChatMessage(role="user", content=inp)]
    out: list[P.ChatMessage] = []
    for i, item in enumerate(inp or []):
        p = f"input[{i}]"
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            out.append(_message(p, item))
        elif kind == "function_call":
            _need(p, item, "call_id", "name", "arguments")
            call = P.ToolCall(id=item.call_id, function=P.FunctionCall(
                name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                out.append(P.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            _need(p, item, "call_id")
            if item.output is None:
                raise OpenAIError(400, f"'{p}.output' is required for a function_call_output "
                                       f"item", f"{p}.output")
            out.append(P.ChatMessage(role="tool", tool_call_id=item.call_id,
                                     content=_text(f"{p}.output", item.output)))
        elif kind == "reasoning":
            continue
        else:
            raise OpenAIError(400, f"'{p}.type' must be 'message', 'function_call' or "
                                   f"'function_call_output'; got {kind!r}", f"{p}.type")
    if not out:
        raise OpenAIError(400, "'input' holds no message", "input")
    return out


def _message(p: str, item: Item) -> P.ChatMessage:
    if item.role not in ("user", "assistant", "system", "developer"):
        raise OpenAIError(400, f"'{p}.role' must be 'user', 'assistant', 'system' or "
                               f"'developer'; got {item.role!r}", f"{p}.role")
    if item.content is None:
        raise OpenAIError(400, f"'{p}.content' is required", f"{p}.content")
    return P.ChatMessage(role=item.role, content=_text(f"{p}.content", item.content))


def _text(p: str, content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text"):
            raise OpenAIError(400, f"'{p}[{j}].type' is {part.type!r}; only text parts "
                                   f"(input_text, output_text) are supported", f"{p}[{j}].type")
        if part.text is None:
            raise OpenAIError(400, f"'{p}[{j}].text' is required", f"{p}[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def _need(p: str, item: Item, *names: str) -> None:
    for name in names:
        if not getattr(item, name):
            raise OpenAIError(400, f"'{p}.{name}' is required for a {item.type} item",
                              f"{p}.{name}")


# ---- tools and format --------------------------------------------------------------------


def _tools(tools: list[RTool] | None) -> list[P.Tool] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise OpenAIError(400, f"'tools[{i}].type' is {t.type!r}; only 'function' tools "
                                   f"are supported by this server", f"tools[{i}].type")
        if t.name is None:
            raise OpenAIError(400, f"'tools[{i}].name' is required", f"tools[{i}].name")
        out.append(P.Tool(function=P.FunctionDef(name=t.name, description=t.description,
                                                 parameters=t.parameters, strict=t.strict)))
    return out


def _tool_choice(choice: str | RToolChoice | None):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise OpenAIError(400, f"'tool_choice.type' must be 'function', got {choice.type!r}",
                          "tool_choice.type")
    if not choice.name:
        raise OpenAIError(400, "'tool_choice.name' is required", "tool_choice.name")
    return P.ToolChoiceNamed(function=P.NamedFunction(name=choice.name))


def _format(text: TextConfig | None) -> P.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise OpenAIError(400, "'text.format.schema' is required when 'text.format.type' "
                                   "is 'json_schema'", "text.format.schema")
        return P.ResponseFormat(type="json_schema", json_schema=P.JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))
    return P.ResponseFormat(type=fmt.type)


_RENAMES = [(re.compile(r"^messages(\[\d+\])?"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\."), "text.format."),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1].")]


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-path error with its param (and the param's mention in the message) in
    Responses terms."""
    if not e.param:
        return e
    param = e.param
    for pattern, repl in _RENAMES:
        param = pattern.sub(repl, param, count=1)
    message = e.message.replace(f"'{e.param}'", f"'{param}'")
    for old, new in (("'response_format'", "'text.format'"), ("'messages'", "'input'")):
        message = message.replace(old, new)
    return OpenAIError(e.status, message, param, code=e.code, type=e.type)

