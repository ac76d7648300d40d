"""Anthropic Messages API request -> a chat request -> `Job` (validate.prepare_chat).

    system (text or text blocks)          -> a system message first
    user content: text blocks             -> a user message
                  tool_result blocks      -> tool messages (tool_call_id = tool_use_id),
                                             before the user's text
    assistant content: text, tool_use     -> an assistant message with tool_calls
    a last assistant message (prefill)    -> generation continues it: the prompt ends with
                                             its text, the answer holds only what follows
    tools [{name, description, input_schema}]
    tool_choice auto / any / tool {name} / none -> TOOLS_AUTO / TOOLS_REQUIRED / TOOL_NAMED /
                                             NONE, the Constraint that crosses PD;
                                             disable_parallel_tool_use -> one call at most
    output_config.format {type: json_schema, schema} -> response_format json_schema
    stop_sequences, max_tokens (required), temperature [0, 1], top_p, top_k

Anthropic's rules are checked here (max_tokens required, temperature at most 1, roles
user / assistant only); everything else by the chat path. Errors are OpenAIErrors; the
routes render them as {"type": "error", "error": {"type": ..., "message": ...}}.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from .. import protocol as P
from ..model import ModelSpec
from ..protocol import OpenAIError
from ..validate import decode_body, fit_context, prepare_chat
from .common import Job


class Inner(msgspec.Struct, kw_only=True):
    """A block inside a tool_result's content."""
    type: str
    text: str | None = None


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None                       # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None              # tool_result
    content: str | list[Inner] | None = None
    is_error: bool | None = None
    cache_control: Any = None
    citations: Any = None


class AMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class ATool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    cache_control: Any = None


class AToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AFormat(msgspec.Struct, kw_only=True):
    type: str
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class OutputConfig(msgspec.Struct, kw_only=True):
    format: AFormat | None = None
    effort: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int
    messages: list[AMessage]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    # pdmesh extras (vLLM-style): seeded sampling and the placement switch
    seed: int | None = None
    pdmesh_path: str | None = None


class Ctx(msgspec.Struct, kw_only=True):
    stop_sequences: tuple[str, ...] = ()


def parse_messages(body: bytes, spec: ModelSpec) -> Job:
    req = decode_body(body, MessagesRequest)
    _check(req)
    messages, prefill = _messages(req)
    system = _system(req.system)
    kind, name, parallel = _choice(req.tool_choice, req.tools)
    chat = P.ChatCompletionRequest(
        model=req.model, messages=system + messages, max_tokens=req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        stop=req.stop_sequences, pdmesh_path=req.pdmesh_path,
        tools=[P.Tool(function=P.FunctionDef(name=t.name, description=t.description,
                                             parameters=t.input_schema))
               for t in req.tools] if req.tools else None,
        tool_choice=P.ToolChoiceNamed(function=P.NamedFunction(name=name)) if name else kind,
        parallel_tool_calls=parallel, response_format=_format(req.output_config))
    try:
        prep = prepare_chat(chat, spec)
    except OpenAIError as e:
        raise _renamed(e) from None
    if prefill:
        prep = _continue(prep, prefill, spec, req.max_tokens)
    return Job(prep, bool(req.stream), Ctx(stop_sequences=tuple(req.stop_sequences or ())))


def _format(config: OutputConfig | None) -> P.ResponseFormat | None:
    """output_config.format (structured outputs) -> a json_schema response_format."""
    fmt = config.format if config is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        raise OpenAIError(400, f"output_config.format.type: must be 'json_schema', got "
                               f"{fmt.type!r}", "output_config.format.type")
    if fmt.schema_ is None:
        raise OpenAIError(400, "output_config.format.schema: Field required",
                          "output_config.format.schema")
    return P.ResponseFormat(type="json_schema",
                            json_schema=P.JsonSchemaFormat(name="output", schema_=fmt.schema_))


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-path error in Messages terms (the fields Anthropic names differently)."""
    message, param = e.message, e.param
    for old, new in (("'response_format'", "'output_config.format'"),
                     ("'stop'", "'stop_sequences'")):
        message = message.replace(old, new)
    if param in ("response_format", "stop"):
        param = {"response_format": "output_config.format", "stop": "stop_sequences"}[param]
    return OpenAIError(e.status, message, param, code=e.code, type=e.type)


def _check(req: MessagesRequest) -> None:
    if req.max_tokens < 1:
        raise OpenAIError(400, f"max_tokens: must be at least 1, got {req.max_tokens}",
                          "max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise OpenAIError(400, f"temperature: must be in [0, 1], got {req.temperature}",
                          "temperature")
    if not req.messages:
        raise OpenAIError(400, "messages: at least one message is required", "messages")
    if req.thinking and req.thinking.get("type") not in (None, "disabled"):
        raise OpenAIError(400, "thinking: extended thinking is not supported by this server",
                          "thinking")


def _system(system: str | list[Block] | None) -> list[P.ChatMessage]:
    if not system:
        return []
    if isinstance(system, str):
        return [P.ChatMessage(role="system", content=system)]
    texts = []
    for j, b in enumerate(system):
        if b.type != "text" or b.text is None:
            raise OpenAIError(400, f"system.{j}: only text blocks are allowed in 'system'",
                              "system")
        texts.append(b.text)
    return [P.ChatMessage(role="system", content="\n".join(texts))]


def _messages(req: MessagesRequest) -> tuple[list[P.ChatMessage], str]:
    """(chat messages, the text of a final assistant message to continue or "")."""
    out: list[P.ChatMessage] = []
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise OpenAIError(400, f"messages.{i}.role: must be 'user' or 'assistant', got "
                                   f"{m.role!r}", f"messages.{i}.role")
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        out += (_user(i, blocks) if m.role == "user" else [_assistant(i, blocks)])
    last = req.messages[-1]
    if last.role == "assistant" and not out[-1].tool_calls:
        return out[:-1], out[-1].content or ""
    return out, ""


def _user(i: int, blocks: list[Block]) -> list[P.ChatMessage]:
    results, texts = [], []
    for j, b in enumerate(blocks):
        p = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(_need_text(p, b.text))
        elif b.type == "tool_result":
            if not b.tool_use_id:
                raise OpenAIError(400, f"{p}.tool_use_id: Field required", f"{p}.tool_use_id")
            content = _result_text(p, b.content)
            if b.is_error:
                content = f"Error: {content}"
            results.append(P.ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                         content=content))
        else:
            raise OpenAIError(400, f"{p}.type: {b.type!r} blocks are not supported in user "
                                   f"messages (only text and tool_result)", f"{p}.type")
    if not results and not texts:
        raise OpenAIError(400, f"messages.{i}.content: must not be empty",
                          f"messages.{i}.content")
    return results + ([P.ChatMessage(role="user", content="\n".join(texts))] if texts else [])


def _assistant(i: int, blocks: list[Block]) -> P.ChatMessage:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        p = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(_need_text(p, b.text))
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise OpenAIError(400, f"{p}: a tool_use block needs 'id' and 'name'", p)
            calls.append(P.ToolCall(id=b.id, function=P.FunctionCall(
                name=b.name, arguments=json.dumps(b.input or {}, ensure_ascii=False))))
        elif b.type not in ("thinking", "redacted_thinking"):
            raise OpenAIError(400, f"{p}.type: {b.type!r} blocks are not supported in "
                                   f"assistant messages (only text and tool_use)", f"{p}.type")
    return P.ChatMessage(role="assistant", content="".join(texts) if texts or not calls
                         else None, tool_calls=calls or None)


def _need_text(p: str, text: str | None) -> str:
    if text is None:
        raise OpenAIError(400, f"{p}.text: Field required", f"{p}.text")
    return text


def _result_text(p: str, content: str | list[Inner] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, b in enumerate(content):
        if b.type != "text" or b.text is None:
            raise OpenAIError(400, f"{p}.content.{k}: only text blocks are supported in a "
                                   f"tool_result", f"{p}.content.{k}")
        texts.append(b.text)
    return "\n".join(texts)


def _choice(choice: AToolChoice | None, tools) -> tuple[str | None, str | None, bool | None]:
    """(chat tool_choice, named tool, parallel_tool_calls)."""
    if choice is None:
        return None, None, None
    parallel = False if choice.disable_parallel_tool_use else None
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type in kinds:
        if choice.type == "any" and not tools:
            raise OpenAIError(400, "tool_choice: 'any' requires 'tools'", "tool_choice")
        return kinds[choice.type], None, parallel
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError(400, "tool_choice.name: Field required", "tool_choice.name")
        return None, choice.name, parallel
    raise OpenAIError(400, f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got "
                           f"{choice.type!r}", "tool_choice.type")


def _continue(prep, prefill: str, spec: ModelSpec, max_tokens: int):
    """Prefill: the prompt ends inside the assistant turn, with the given text."""
    ids = prep.prompt_ids + spec.tokenizer.encode(prefill, add_special_tokens=False)
    fit = fit_context(len(ids), max_tokens, spec.max_model_len, "messages", "max_tokens")
    params = msgspec.structs.replace(prep.params, max_tokens=fit)
    return type(prep)(ids, params, prep.constraint, prep.options)
