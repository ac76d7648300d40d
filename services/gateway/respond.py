"""The chat and completions renderer: one answer's events (answer.events) -> the HTTP
answer, one JSON body or SSE.

Whatever way the answer ends before decode finished the request (client gone, timeout,
instance lost, gateway shutdown, a write that fails), decode is told to abort it.

With tools on (Options.tool_calls), a whole answer gets message.tool_calls (content None
when the output is only calls); a stream gets `delta.tool_calls` (each call whole when its
close tag arrives, shared.toolcalls.openai_deltas). Either way finish_reason is
"tool_calls" when there is at least one call. Re-dispatch and migration happen below the
events (answer.next_chunk): a stream's role chunk does not count as shown output.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from shared.toolcalls import Call, openai_deltas

from . import access, protocol as P
from .aborting import AbortOnExit, fail_stream
from .answer import REPETITION, Answer, Event, Piece, drain, events, shown
from .dispatch import DecodeClient, Dispatch
from .metrics import Metrics
from .protocol import OpenAIError
from .slowclients import sse_response
from .validate import Prepared

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def answer(request: web.Request, client: DecodeClient, d: Dispatch, prep: Prepared,
                 rid: str, arrival: float, metrics: Metrics,
                 token_text: Callable[[int], str]) -> web.StreamResponse:
    deadline = arrival + client.request_timeout_s
    ans = Answer(prep, d, arrival, metrics, token_text, rid)
    access.note(request, [ans])
    async with AbortOnExit(client, metrics, [ans]):
        if prep.options.stream:
            return await _stream(request, client, ans, rid, deadline)
        return await _complete(request, client, ans, rid, deadline)


def client_gone(request: web.Request) -> Callable[[], bool]:
    def gone() -> bool:
        tr = request.transport
        return tr is None or tr.is_closing()
    return gone


async def _complete(request, client, ans: Answer, rid, deadline) -> web.Response:
    await drain(client, ans, deadline, client_gone(request))
    d = ans.d
    body = whole_body(ans, rid, int(time.time()))
    return web.Response(body=P.dumps(body), content_type="application/json",
                        headers={"x-pdmesh-path": d.path.value, "x-pdmesh-decode": d.instance})


def whole_body(ans: Answer, rid: str, created: int) -> dict:
    """A drained answer's JSON body (one choice, index 0)."""
    o = ans.prep.options
    finish = ans.end.reason
    if o.chat:
        content, calls = ans.message()
        body = P.chat_completion(rid, created, o.model, content, finish, ans.usage,
                                 ans.all_logprobs(), tool_calls=[P.tool_call(c) for c in calls])
    else:
        body = P.completion(rid, created, o.model, ans.text, finish, ans.usage,
                            ans.all_logprobs())
    if o.return_token_ids:
        body["choices"][0]["token_ids"] = ans.token_ids
    if ans.stop_reason == REPETITION:      # vLLM's stop_reason field, for why it was cut
        body["choices"][0]["stop_reason"] = REPETITION
    return body


async def _stream(request, client, ans: Answer, rid, deadline) -> web.StreamResponse:
    d = ans.d
    created = int(time.time())
    resp = sse_response(request, SSE_HEADERS | {"x-pdmesh-path": d.path.value,
                                                "x-pdmesh-decode": d.instance})
    await resp.prepare(request)
    sse = SseStream(resp, ans.prep, rid, created)
    try:
        await sse.role()
        async for e in events(client, ans, deadline, client_gone(request), stream=True):
            await sse.event(e)
        if ans.prep.options.include_usage:
            await sse.usage(ans.usage)
    except OpenAIError as e:
        # headers are gone: the error travels as an SSE event, then [DONE]
        await fail_stream(client, ans.metrics, ans.d, e)
        await resp.write(P.sse(e.body()))
    await resp.write(P.SSE_DONE)
    await resp.write_eof()
    return resp


class SseStream:
    """Events -> chat.completion.chunk / text_completion SSE events on one response.
    index: the choice's (n > 1, choices.py)."""

    def __init__(self, resp: web.StreamResponse, prep: Prepared, rid: str, created: int):
        self.resp, self.rid, self.created = resp, rid, created
        self.o = prep.options

    async def role(self, index: int = 0) -> None:
        """A chat stream opens each choice with its role."""
        if self.o.chat:
            await self.resp.write(self.chunk(index, {"role": "assistant", "content": ""}))

    async def event(self, e: Event, index: int = 0) -> None:
        o = self.o
        if isinstance(e, Piece):
            if shown(e, o.return_token_ids):
                ids = e.token_ids if o.return_token_ids else None
                delta = ({"content": e.text} if e.text or e.logprobs else {}) if o.chat else e.text
                await self.resp.write(self.chunk(index, delta, lp=e.logprobs, ids=ids))
        elif isinstance(e, Call):
            for delta in openai_deltas([e]):
                await self.resp.write(self.chunk(index, delta))
        else:
            await self.resp.write(self.chunk(index, {} if o.chat else "", finish=e.reason,
                                             stop_reason=e.stop_reason))

    async def usage(self, usage: dict) -> None:
        o = self.o
        await self.resp.write(P.sse(P.usage_chunk(self.rid, self.created, o.model, o.chat,
                                                  usage)))

    def chunk(self, index: int, delta: dict | str, finish: str | None = None,
              lp: dict | None = None, ids: list[int] | None = None,
              stop_reason: str | int | None = None) -> bytes:
        """One SSE event: a chat delta (dict) or completion text (str) of choice `index`."""
        o = self.o
        if o.chat:
            body = P.chat_chunk(self.rid, self.created, o.model, delta, finish, lp,
                                o.include_usage)
        else:
            body = P.completion_chunk(self.rid, self.created, o.model, delta, finish, lp,
                                      o.include_usage)
        body["choices"][0]["index"] = index
        if ids:
            body["choices"][0]["token_ids"] = ids
        if stop_reason == REPETITION:
            body["choices"][0]["stop_reason"] = REPETITION
        return P.sse(body)
