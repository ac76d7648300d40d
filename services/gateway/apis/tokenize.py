"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

    /tokenize   {"prompt": "text", "add_special_tokens": true}
                {"messages": [...], "add_generation_prompt": true, "continue_final_message":
                 false, "add_special_tokens": false, "tools": [...]}
                -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": null}
                   ("return_token_strs": true fills token_strs)
    /detokenize {"tokens": [...]} -> {"prompt": "text"}

The messages go through the same template and tool rendering as /v1/chat/completions, so
the count is the chat request's prompt length. Errors: OpenAI error bodies, 4xx.
"""
from __future__ import annotations

from typing import Any

import msgspec

from .. import protocol as P
from ..model import ModelSpec
from ..protocol import OpenAIError
from ..structured import openai_tools
from ..validate import check_model, decode_body, message_dict, template_errors


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[P.Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def tokenize(body: bytes, spec: ModelSpec) -> dict:
    req = decode_body(body, TokenizeRequest)
    check_model(req.model, spec)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "send exactly one of 'prompt' and 'messages'",
                          "prompt" if req.prompt is not None else "messages")
    tok = spec.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        ids = _chat_ids(req, spec)
    out = {"count": len(ids), "max_model_len": spec.max_model_len, "tokens": ids,
           "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
    return out


def _chat_ids(req: TokenizeRequest, spec: ModelSpec) -> list[int]:
    if not req.messages:
        raise OpenAIError(400, "'messages' must contain at least one message", "messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise OpenAIError(400, "'continue_final_message' and 'add_generation_prompt' cannot "
                               "both be true", "continue_final_message")
    messages = [message_dict(i, m) for i, m in enumerate(req.messages)]
    tail = ""
    if req.continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise OpenAIError(400, "'continue_final_message' needs a final 'assistant' message",
                              "continue_final_message")
        tail = messages.pop()["content"]
    tok = spec.tokenizer
    try:
        text = tok.render_chat(messages, openai_tools(req.tools),
                               add_generation_prompt=req.add_generation_prompt or bool(tail))
    except template_errors() as e:
        raise OpenAIError(400, f"the chat template cannot render these messages: {e}",
                          "messages") from e
    return tok.encode(text + tail, add_special_tokens=bool(req.add_special_tokens))


def detokenize(body: bytes, spec: ModelSpec) -> dict:
    req = decode_body(body, DetokenizeRequest)
    check_model(req.model, spec)
    bad = [t for t in req.tokens if not 0 <= t < spec.vocab_size]
    if bad:
        raise OpenAIError(400, f"'tokens' out of range [0, {spec.vocab_size}): {bad[:5]}",
                          "tokens")
    return {"prompt": spec.tokenizer.decode(req.tokens)}
