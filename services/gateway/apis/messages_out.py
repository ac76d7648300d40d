"""An Anthropic Messages answer: the message, whole or as Messages stream events, and
Anthropic-shaped errors.

    content: [text]? [tool_use {id: toolu_..., name, input}]*
    stop_reason: end_turn | max_tokens | stop_sequence (+ stop_sequence) | tool_use
    usage: input_tokens (not served from a cache), cache_read_input_tokens, output_tokens

Stream: message_start, then per block content_block_start, content_block_delta
(text_delta / input_json_delta)*, content_block_stop, then message_delta (stop_reason,
usage) and message_stop. An error after the headers: `event: error` with the error body.
"""
from __future__ import annotations

import json

from aiohttp import web

from shared.contracts.messages import FinishReason
from shared.toolcalls import Call

from .. import protocol as P
from ..aborting import fail_stream
from ..answer import Piece
from ..protocol import OpenAIError
from .common import Turn
from .messages import Ctx

# HTTP status -> Anthropic error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(e: OpenAIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: OpenAIError) -> web.Response:
    return web.Response(status=e.status, body=P.dumps(error_body(e)),
                        content_type="application/json", headers=getattr(e, "headers", None))


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(call: Call) -> dict:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


def usage(turn: Turn, final: bool = True) -> dict:
    a = turn.ans
    cached = a.cached_tokens
    return {"input_tokens": a.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": (a.reported or a.counted) if final else 0}


def stop(turn: Turn, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if calls:
        return "tool_use", None
    if turn.ans.finish_reason == FinishReason.LENGTH.value:
        return "max_tokens", None
    ctx: Ctx = turn.job.ctx
    matched = turn.ans.stop_reason
    if isinstance(matched, str) and matched in ctx.stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def message(turn: Turn, content: list[dict], reason: str | None, seq: str | None,
            final: bool = True) -> dict:
    return {"id": turn.rid, "type": "message", "role": "assistant",
            "model": turn.job.prep.options.model, "content": content, "stop_reason": reason,
            "stop_sequence": seq, "usage": usage(turn, final)}


async def respond_whole(turn: Turn) -> web.Response:
    text, calls = (await turn.whole()).message()
    content = [{"type": "text", "text": text}] if text else []
    content += [tool_use(c) for c in calls]
    reason, seq = stop(turn, bool(calls))
    return web.Response(body=P.dumps(message(turn, content, reason, seq)),
                        content_type="application/json", headers=turn.headers())


class _Events:
    def __init__(self, turn: Turn):
        self.turn = turn
        self.index = -1            # the current block
        self.open_text = False
        self.calls = 0

    async def send(self, kind: str, **data) -> None:
        await self.turn.resp.write(f"event: {kind}\n".encode() + P.sse({"type": kind, **data}))

    async def start(self) -> None:
        await self.turn.open_stream()
        await self.send("message_start", message=message(self.turn, [], None, None, False))
        await self.send("ping")

    async def text(self, delta: str) -> None:
        if not delta:
            return
        if not self.open_text:
            self.index += 1
            self.open_text = True
            await self.send("content_block_start", index=self.index,
                            content_block={"type": "text", "text": ""})
        self.turn.ans.sent = True
        await self.send("content_block_delta", index=self.index,
                        delta={"type": "text_delta", "text": delta})

    async def close(self) -> None:
        if self.open_text:
            await self.send("content_block_stop", index=self.index)
            self.open_text = False

    async def call(self, call: Call) -> None:
        await self.close()
        self.turn.ans.sent = True
        self.index += 1
        self.calls += 1
        block = tool_use(call) | {"input": {}}
        await self.send("content_block_start", index=self.index, content_block=block)
        await self.send("content_block_delta", index=self.index,
                        delta={"type": "input_json_delta", "partial_json": call.arguments})
        await self.send("content_block_stop", index=self.index)

    async def finish(self) -> None:
        await self.close()
        reason, seq = stop(self.turn, self.calls > 0)
        await self.send("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                        usage=usage(self.turn))
        await self.send("message_stop")


async def respond_stream(turn: Turn) -> web.StreamResponse:
    ev = _Events(turn)
    turn.on_start = ev.start
    try:
        async for e in turn.events():
            if isinstance(e, Piece) and e.text:
                await ev.text(e.text)
            elif isinstance(e, Call):
                await ev.call(e)
        await ev.finish()
    except OpenAIError as e:
        if turn.resp is None:
            raise
        await fail_stream(turn.gw.client, turn.gw.metrics, turn.ans.d, e)
        await turn.resp.write(b"event: error\n" + P.sse(error_body(e)))
    await turn.resp.write_eof()
    return turn.resp

