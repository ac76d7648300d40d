"""A Responses API answer: the `response` object, whole or as Responses stream events.

    output: [message {output_text}]? then [function_call {call_id, name, arguments}]*
    status: "completed", or "incomplete" (incomplete_details.reason "max_output_tokens")
    usage:  input_tokens (+ input_tokens_details.cached_tokens), output_tokens, total_tokens

Stream (each `event: <type>` + JSON data with sequence_number): response.created,
response.in_progress, then per text item output_item.added, content_part.added,
output_text.delta*, output_text.done, content_part.done, output_item.done; per function
call output_item.added, function_call_arguments.delta, function_call_arguments.done,
output_item.done; then response.completed (or response.incomplete). An error after the
headers: `error`, then response.failed. With store on, the response and its conversation
go to the store (store.py), under the request's tenant, once it is finished.
"""
from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from shared.contracts.messages import FinishReason
from shared.toolcalls import Call

from .. import protocol as P
from ..aborting import fail_stream
from ..answer import Piece
from ..auth import TENANT
from ..protocol import OpenAIError
from .common import Turn
from .responses import Ctx
from .store import ResponseStore


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [output_text(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: Call, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else ""}


def usage(turn: Turn) -> dict:
    a = turn.ans
    out = a.reported or a.counted
    return {"input_tokens": a.prompt_tokens,
            "input_tokens_details": {"cached_tokens": a.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": a.prompt_tokens + out}


def response_obj(turn: Turn, status: str, output: list[dict], error: dict | None = None) -> dict:
    ctx: Ctx = turn.job.ctx
    req, params = ctx.req, turn.job.prep.params
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {
        "id": turn.rid, "object": "response", "created_at": turn.created, "status": status,
        "background": False, "error": error,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "model": turn.job.prep.options.model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": ctx.store,
        "temperature": params.temperature, "top_p": params.top_p,
        "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        "tool_choice": (msgspec.to_builtins(choice) if choice is not None
                        else "auto" if req.tools else "none"),
        "tools": msgspec.to_builtins(req.tools or []), "truncation": "disabled",
        "usage": usage(turn) if status != "in_progress" else None, "user": req.user}


def _status(turn: Turn) -> str:
    return "incomplete" if turn.ans.finish_reason == FinishReason.LENGTH.value else "completed"


def _remember(store: ResponseStore, turn: Turn, response: dict, text: str | None,
              calls: list[Call]) -> None:
    ctx: Ctx = turn.job.ctx
    if not ctx.store:
        return
    tool_calls = [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name,
                                                              arguments=c.arguments))
                  for c in calls] or None
    reply = P.ChatMessage(role="assistant", content=text if text or not calls else None,
                          tool_calls=tool_calls)
    store.put(turn.rid, response, ctx.history + [reply],
              tenant=turn.request.get(TENANT, ""))


async def respond_whole(turn: Turn, store: ResponseStore) -> web.Response:
    text, calls = (await turn.whole()).message()
    output = [message_item(_id("msg"), text)] if text or not calls else []
    output += [call_item(_id("fc"), c) for c in calls]
    body = response_obj(turn, _status(turn), output)
    _remember(store, turn, body, text, calls)
    return web.Response(body=P.dumps(body), content_type="application/json",
                        headers=turn.headers())


class _Events:
    """The SSE side of one streamed response."""

    def __init__(self, turn: Turn):
        self.turn, self.seq = turn, 0
        self.output: list[dict] = []          # finished items
        self.msg: tuple[str, list[str]] | None = None   # the open message item: id, texts
        self.texts: list[str] = []
        self.calls: list[Call] = []

    async def send(self, kind: str, **data) -> None:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        await self.turn.resp.write(f"event: {kind}\n".encode() + P.sse(data))

    async def start(self) -> None:
        await self.turn.open_stream()
        head = response_obj(self.turn, "in_progress", [])
        await self.send("response.created", response=head)
        await self.send("response.in_progress", response=head)

    async def text(self, delta: str) -> None:
        idx = len(self.output)
        if self.msg is None:
            self.msg = (_id("msg"), [])
            await self.send("response.output_item.added", output_index=idx,
                            item=message_item(self.msg[0], "", "in_progress"))
            await self.send("response.content_part.added", item_id=self.msg[0],
                            output_index=idx, content_index=0, part=output_text(""))
        self.turn.ans.sent = True
        self.msg[1].append(delta)
        self.texts.append(delta)
        await self.send("response.output_text.delta", item_id=self.msg[0], output_index=idx,
                        content_index=0, delta=delta, logprobs=[])

    async def close_text(self) -> None:
        if self.msg is None:
            return
        (mid, parts), idx = self.msg, len(self.output)
        text = "".join(parts)
        await self.send("response.output_text.done", item_id=mid, output_index=idx,
                        content_index=0, text=text, logprobs=[])
        await self.send("response.content_part.done", item_id=mid, output_index=idx,
                        content_index=0, part=output_text(text))
        item = message_item(mid, text)
        await self.send("response.output_item.done", output_index=idx, item=item)
        self.output.append(item)
        self.msg = None

    async def call(self, call: Call) -> None:
        await self.close_text()
        self.turn.ans.sent = True
        idx, fid = len(self.output), _id("fc")
        await self.send("response.output_item.added", output_index=idx,
                        item=call_item(fid, call, "in_progress"))
        await self.send("response.function_call_arguments.delta", item_id=fid,
                        output_index=idx, delta=call.arguments)
        await self.send("response.function_call_arguments.done", item_id=fid,
                        output_index=idx, arguments=call.arguments, name=call.name)
        item = call_item(fid, call)
        await self.send("response.output_item.done", output_index=idx, item=item)
        self.output.append(item)
        self.calls.append(call)

    async def finish(self) -> dict:
        if not self.output and self.msg is None:     # no output at all: an empty message
            await self.text("")
        await self.close_text()
        status = _status(self.turn)
        body = response_obj(self.turn, status, self.output)
        await self.send("response.completed" if status == "completed"
                        else "response.incomplete", response=body)
        return body

    async def fail(self, e: OpenAIError) -> None:
        await self.send("error", code=e.code, message=e.message, param=e.param)
        await self.send("response.failed", response=response_obj(
            self.turn, "failed", self.output, error={"code": e.code or "server_error",
                                                     "message": e.message}))


async def respond_stream(turn: Turn, store: ResponseStore) -> web.StreamResponse:
    ev = _Events(turn)
    turn.on_start = ev.start
    try:
        async for e in turn.events():
            if isinstance(e, Piece) and e.text:
                await ev.text(e.text)
            elif isinstance(e, Call):
                await ev.call(e)
        body = await ev.finish()
    except OpenAIError as e:
        if turn.resp is None:          # nothing sent yet: a plain HTTP error
            raise
        await fail_stream(turn.gw.client, turn.gw.metrics, turn.ans.d, e)
        await ev.fail(e)
    else:
        text = "".join(ev.texts)
        _remember(store, turn, body, text if text or not ev.calls else None, ev.calls)
    await turn.resp.write_eof()
    return turn.resp
