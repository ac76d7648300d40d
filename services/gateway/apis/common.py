"""What the Responses and Messages APIs share: one translated request through dispatch
(`run`) and its answer's events (`Turn`: answer.events, the one event stream every API
renders; Piece text and whole tool calls, parsed once).

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

from .. import access, intake
from ..aborting import AbortOnExit
from ..answer import Answer, Event, drain, events
from ..respond import SSE_HEADERS
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
        self.resp: web.StreamResponse | None = None
        # a stream's headers and opening events: sent once the first chunk is in
        self.on_start: Callable[[], Awaitable[None]] | None = None

    def gone(self) -> bool:
        tr = self.request.transport
        return tr is None or tr.is_closing()

    async def events(self) -> AsyncIterator[Event]:
        """The answer's events (answer.events, streamed); the stream's headers and opening
        events go out with the first (on_start)."""
        async for e in events(self.gw.client, self.ans, self.deadline, self.gone, stream=True):
            if self.on_start is not None:
                start, self.on_start = self.on_start, None
                await start()
            yield e

    async def whole(self) -> Answer:
        """The whole answer: ans.message(), ans.finish_reason, ans.stop_reason hold it."""
        return await drain(self.gw.client, self.ans, self.deadline, self.gone)

    async def open_stream(self) -> web.StreamResponse:
        d = self.ans.d
        self.resp = sse_response(self.request, SSE_HEADERS | {"x-pdmesh-path": d.path.value,
                                                              "x-pdmesh-decode": d.instance})
        await self.resp.prepare(self.request)
        return self.resp

    def headers(self) -> dict:
        return {"x-pdmesh-path": self.ans.d.path.value, "x-pdmesh-decode": self.ans.d.instance}


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
