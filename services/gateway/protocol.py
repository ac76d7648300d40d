"""OpenAI wire format: request bodies (strict msgspec Structs) and the response, chunk and
error bodies the gateway sends, field for field as OpenAI writes them.

Unknown request fields are ignored (clients send extras); fields we know but do not serve
yet are declared here so validation can name them in a 400.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from shared.contracts.common import ErrorCode, ErrorReply

# ---- request bodies ----------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceNamed(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None       # choices[].token_ids (vLLM's extension)
    cache_salt: str | None = None              # vLLM's: only requests with the same salt
    #                                            (and API key) share cached prefix blocks
    # pdmesh extension: force the placement ("pd" | "colocated"); default: decode decides
    pdmesh_path: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[Any] | None = None        # deprecated form of tools
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any = None        # str | [str] | [int] | [[int]]: checked by validate
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---- errors ------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error the client sees as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        message = _encodable(message)
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.message!r}, param={self.param!r})"


def _encodable(text: str) -> str:
    """text that encodes as UTF-8: a lone surrogate (from a request header or path that was
    not UTF-8) is written as its escape, or the error body itself could not be sent."""
    return text.encode("utf-8", "backslashreplace").decode()


def overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    """429: refused now rather than queued without bound; the client may retry soon."""
    return OpenAIError(429, f"overloaded: {message}; retry after {retry_after_s}s",
                       code="rate_limit_exceeded", type="requests",
                       headers={"Retry-After": str(retry_after_s)})


# a failed request's error code -> HTTP status: the client's fault, unavailable, or a peer fault
_STATUS = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.OVERLOADED: 503,
           ErrorCode.SHUTTING_DOWN: 503, ErrorCode.INSTANCE_LOST: 503, ErrorCode.ABORTED: 503,
           ErrorCode.PREFILL_FAILED: 503, ErrorCode.ANOMALY: 503}
RETRY_HINT = {ErrorCode.ANOMALY: "; the output so far may be wrong and was not completed: "
                                 "retry the request (a new attempt is served afresh)"}


def chunk_error(err: ErrorReply, instance: str) -> OpenAIError:
    """The error a decode instance ended a request with, as the client sees it."""
    status = _STATUS.get(err.code, 502)
    return OpenAIError(status, f"decode instance {instance}: {err.message}"
                               f"{RETRY_HINT.get(err.code, '')}", code=err.code.value)


# ---- responses ---------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def dumps(obj: dict) -> bytes:
    return _encoder.encode(obj)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def spec_usage(steps: int, proposed: int, accepted: int) -> dict:
    """pdmesh's usage extension when speculative decoding ran: mean tokens per verification
    step, the bonus/correction token included (SGLang's spec_accept_length), and the share
    of drafted tokens accepted."""
    return {"spec_accept_length": round((accepted + steps) / steps, 4),
            "spec_accept_rate": round(accepted / proposed, 4) if proposed else 0.0}


def chat_completion(rid: str, created: int, model: str, text: str | None,
                    finish_reason: str | None, usage_: dict, logprobs: dict | None = None,
                    tool_calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage_, "system_fingerprint": None}


def tool_call(call) -> dict:
    """A parsed shared.toolcalls.Call as message.tool_calls[i]."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, with_usage: bool = False) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": None,
           "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage:   # OpenAI sends "usage": null on every chunk when include_usage is set
        out["usage"] = None
    return out


def completion(rid: str, created: int, model: str, text: str, finish_reason: str | None,
               usage_: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage_, "system_fingerprint": None}


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None,
                     with_usage: bool = False) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None,
           "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": None, "choices": [],
            "usage": usage_}


def model_list(name: str, created: int, max_model_len: int, root: str) -> dict:
    return {"object": "list", "data": [model_card(name, created, max_model_len, root)]}


def model_card(name: str, created: int, max_model_len: int, root: str) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdmesh",
            "root": root, "parent": None, "max_model_len": max_model_len}


# ---- logprobs ----------------------------------------------------------------------------
# decode sends, per generated token: (token_id, logprob, [(top_id, top_logprob), ...] | None)

LogprobEntry = tuple[int, float, list[tuple[int, float]] | None]


def chat_logprobs(entries: list[LogprobEntry], token_text: Callable[[int], str]) -> dict:
    def item(tok: int, lp: float) -> dict:
        s = token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [item(t, lp) | {"top_logprobs": [item(tt, tlp) for tt, tlp in (top or [])]}
                        for t, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: list[LogprobEntry], token_text: Callable[[int], str],
                        text_offset: int) -> dict:
    """Legacy completions format; text_offset is where the first entry's text starts."""
    tokens, offsets, tops = [], [], []
    for t, _lp, top in entries:
        s = token_text(t)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
        tops.append({token_text(tt): tlp for tt, tlp in top} if top is not None else None)
    return {"tokens": tokens, "token_logprobs": [lp for _t, lp, _top in entries],
            "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    return {k: acc[k] + new[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
