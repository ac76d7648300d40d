"""What the Responses and Messages APIs share: one translated request through dispatch
(`run`), its chunks with re-dispatch (`Turn`), and its text as blocks, text or tool calls,
whole (`whole_blocks`) or as it streams (`BlockStream`).

Intake (read, parse, admit, name) is the chat path's own (services/gateway/intake.py).
A translated request is a `Job`: the chat-path `Prepared` (prompt ids, SamplingParams with
the model's defaults, the tools / JSON Constraint that crosses PD in the prefill job) plus
the API's own facts (`ctx`) its answer needs. Streams send their headers only once the
first chunk is in, so a request that fails before any token (decode refused it, prefill
failed) still gets an HTTP error status in the API's own error shape.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from shared.contracts.messages import TokenChunk
from shared.toolcalls import Call, Text, parse_for, stream_for

from .. import access, intake
from ..aborting import AbortOnExit
from ..respond import SSE_HEADERS, Answer, next_chunk
from ..slowclients import sse_response
from ..validate import Prepared

if TYPE_CHECKING:
    from ..app import Gateway


@dataclass(slots=True)
class Job:
    prep: Prepared
    stream: bool
    ctx: Any = None          # the API's request facts its answer echoes or stores


class Turn:
    """One dispatched request being answered."""

    def __init__(self, gw: Gateway, request: web.Request, ans: Answer, job: Job, rid: str):
        self.gw, self.request, self.ans, self.job, self.rid = gw, request, ans, job, rid
        self.deadline = ans.arrival + gw.client.request_timeout_s
        self.created = int(time.time())
        self.last_chunk: TokenChunk | None = None
        self.resp: web.StreamResponse | None = None
        # a stream's headers and opening events: sent once the first chunk is in
        self.on_start: Callable[[], Awaitable[None]] | None = None

    def gone(self) -> bool:
        tr = self.request.transport
        return tr is None or tr.is_closing()

    async def chunks(self) -> AsyncIterator[tuple[TokenChunk, str]]:
        """(chunk, its new text) until decode finished the request; an anomaly abort is
        re-dispatched while nothing reached the client (respond.next_chunk)."""
        while not self.ans.d.finished:
            c = await next_chunk(self.gw.client, self.ans, self.deadline, self.gone)
            text, _lp = self.ans.add(c)
            self.last_chunk = c
            if self.on_start is not None:
                start, self.on_start = self.on_start, None
                await start()
            yield c, text

    async def events(self) -> AsyncIterator[Text | Call]:
        """The output as BlockStream events while it streams, then its final ones. A
        re-dispatch (only before anything was sent) starts the parse afresh."""
        blocks, d = BlockStream(self.rid, self.tools, self.job.prep.constraint), self.ans.d
        async for _c, text in self.chunks():
            if self.ans.d is not d:
                blocks, d = BlockStream(self.rid, self.tools, self.job.prep.constraint), self.ans.d
            for ev in blocks.feed(text):
                yield ev
        for ev in blocks.finish():
            yield ev

    async def whole_text(self) -> str:
        async for _ in self.chunks():
            pass
        return "".join(self.ans.parts)

    async def open_stream(self) -> web.StreamResponse:
        d = self.ans.d
        self.resp = sse_response(self.request, SSE_HEADERS | {"x-pdmesh-path": d.path.value,
                                                              "x-pdmesh-decode": d.instance})
        await self.resp.prepare(self.request)
        return self.resp

    def headers(self) -> dict:
        return {"x-pdmesh-path": self.ans.d.path.value, "x-pdmesh-decode": self.ans.d.instance}

    @property
    def tools(self) -> bool:
        return self.job.prep.options.tool_calls


async def run(gw: Gateway, request: web.Request, parse: Callable[[bytes, Any], Job],
              respond: Callable[[Turn], Awaitable[web.StreamResponse]],
              id_prefix: str) -> web.StreamResponse:
    """Through the one intake (intake.generate), dispatch, answer; decode is told to abort
    whatever did not finish (client gone, error, timeout)."""
    async def answer(job: Job, rid: str, arrival: float) -> web.StreamResponse:
        d = await intake.submit(gw, request, job.prep, rid)
        ans = Answer(job.prep, d, arrival, gw.metrics, gw.token_text, rid)
        access.note(request, [ans])
        async with AbortOnExit(gw.client, gw.metrics, [ans]):
            return await respond(Turn(gw, request, ans, job, rid))
    return await intake.generate(gw, request, parse, f"{id_prefix}_", answer)


# ---- blocks ------------------------------------------------------------------------------


def whole_blocks(text: str, rid: str, tools: bool, constraint=None
                 ) -> tuple[str | None, list[Call]]:
    """The whole output -> (text or None, tool calls): shared.toolcalls' parse, in the
    format the constraint names, when tools are on, else all text."""
    if not tools:
        return text, []
    content, calls = parse_for(constraint, text, rid)
    return content, [Call(i, c["id"], c["function"]["name"], c["function"]["arguments"])
                     for i, c in enumerate(calls)]


class BlockStream:
    """Text deltas -> the tool parser's events (shared.toolcalls: `Text`, or a whole
    `Call` once its close marker arrives), in output order; without tools every delta is
    text."""

    def __init__(self, rid: str, tools: bool, constraint=None):
        self.parser = stream_for(constraint, rid) if tools else None

    def feed(self, text: str) -> list[Text | Call]:
        if not text:
            return []
        return [Text(text)] if self.parser is None else self.parser.feed(text)

    def finish(self) -> list[Text | Call]:
        return self.parser.finish() if self.parser is not None else []
