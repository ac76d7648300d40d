"""What the Responses and Messages APIs share: one translated request through dispatch
(`run`), its chunks with re-dispatch (`Turn`), and its text as blocks, text or tool calls,
whole (`whole_blocks`) or as it streams (`BlockStream`).

A translated request is a `Job`: the chat-path `Prepared` (prompt ids, SamplingParams with
the model's defaults, the tools / JSON Constraint that crosses PD in the prefill job) plus
the API's own facts (`ctx`) its answer needs. Streams send their headers only once the
first chunk is in, so a request that fails before any token (decode refused it, prefill
failed) still gets an HTTP error status in the API's own error shape.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from shared.contracts.messages import TokenChunk
from shared.toolcalls import parse_for, stream_for

from .. import auth
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


@dataclass(slots=True)
class Call:
    id: str                  # call_<24 hex>
    name: str
    arguments: str           # JSON text of an object


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

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
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
    """Read, translate (gw.prepare: off the event loop), dispatch, answer; decode is told
    to abort whatever did not finish (client gone, error, timeout)."""
    arrival = time.monotonic()
    job = await gw.prepare(parse, await gw.read_body(request))   # 408 past --body-timeout-s
    key = request.get(auth.TENANT, "")
    gw.admit(key)        # in flight from here; 503 draining, 429 past the caps (all, per key)
    try:
        rid = f"{id_prefix}_{uuid.uuid4().hex}"
        p = job.prep
        d = await gw.client.submit(rid, p.prompt_ids, p.params, p.constraint,
                                   p.options.force_path, gw.cache_salt(request, p))
        gw.metrics.placements.inc(placement=d.path.value)
        ans = Answer(p, d, arrival, gw.metrics, gw.token_text, rid)
        async with AbortOnExit(gw.client, gw.metrics, [ans]):
            return await respond(Turn(gw, request, ans, job, rid))
    finally:
        gw.done(key)


# ---- blocks ------------------------------------------------------------------------------


def whole_blocks(text: str, rid: str, tools: bool, constraint=None
                 ) -> tuple[str | None, list[Call]]:
    """The whole output -> (text or None, tool calls): shared.toolcalls' parse, in the
    format the constraint names, when tools are on, else all text."""
    if not tools:
        return text, []
    content, calls = parse_for(constraint, text, rid)
    return content, [Call(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in calls]


class BlockStream:
    """Text deltas -> events: ("text", str) or ("call", Call), in output order. A call is
    whole when its close tag arrives (ToolCallStreamParser holds back anything that may
    still become a tag); without tools every delta is text."""

    def __init__(self, rid: str, tools: bool, constraint=None):
        self.parser = stream_for(constraint, rid) if tools else None
        self._head: dict | None = None

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.parser is None:
            return [("text", text)] if text else []
        return self._events(self.parser.feed(text)) if text else []

    def finish(self) -> list[tuple[str, Any]]:
        return self._events(self.parser.finish()) if self.parser is not None else []

    def _events(self, deltas: list[dict]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for d in deltas:
            if "content" in d:
                out.append(("text", d["content"]))
                continue
            tc = d["tool_calls"][0]
            if "id" in tc:                       # the call's head: id, name
                self._head = tc
            else:                                # its arguments: the call is whole
                head = self._head or {}
                out.append(("call", Call(head.get("id", ""), head.get("function", {})
                                         .get("name", ""), tc["function"]["arguments"])))
                self._head = None
        return out
