"""`n > 1` (chat and completions): n choices that share the prompt's KV blocks.

Choice 0 is dispatched like any request. Once its first chunk is in, its decode instance
has computed the prompt and indexed the prompt's whole blocks in its L1 prefix cache
(engine.resume on the PD path, engine.step on the colocated one), so choices 1..n-1 go to
that same instance (DecodeClient.submit(prefer=...)) and attach those blocks by reference
count instead of prefilling the prompt again: only the tail past the last whole block (in
deterministic mode, the last whole chunk) is computed per choice.

Choice i samples with seed s + i (s: the request's seed, drawn when it gave none), so
choice i equals a single request with seed s + i, whatever its placement. Each choice is a
request of its own to decode (its own Answer and Dispatch): an anomaly re-dispatch or a
migration after a lost instance (answer.next_chunk) moves only that choice.

The answer is a merge of the choices' event streams (answer.events), each event tagged with
its choice's index, rendered as one request's: `choices[i].index` = i; a stream interleaves
the choices' chunks, each carrying its index (OpenAI's shape: a role chunk and a finish
chunk per choice); usage counts the prompt once (with choice 0's cached_tokens: what the
prompt cost) and sums completions. One choice failing fails the request (an error status,
or an SSE error event once streaming).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from . import access, intake, protocol as P
from .aborting import AbortOnExit, close
from .answer import Answer, Event, events
from .protocol import OpenAIError
from .respond import SSE_HEADERS, SseStream, client_gone, whole_body
from .slowclients import sse_response
from .validate import Prepared

if TYPE_CHECKING:
    from .app import Gateway

_SEEDS = 1 << 64
_rng = random.Random()
_DONE = object()


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """seed, seed + 1, ... (wrapped into 64 bits: the sampler reads seeds mod 2**64)."""
    s = _rng.getrandbits(63) if seed is None else seed
    return [s + i if s + i < _SEEDS else s + i - _SEEDS for i in range(n)]


class Choices:
    """The n choices of one request: dispatch (choice 0 first), merge, abort."""

    def __init__(self, gw: Gateway, request: web.Request, prep: Prepared, rid: str,
                 arrival: float):
        self.gw, self.request, self.prep, self.rid = gw, request, prep, rid
        self.arrival = arrival
        self.client = gw.client
        self.deadline = arrival + self.client.request_timeout_s
        self.gone = client_gone(request)
        self.seeds = choice_seeds(prep.params.seed, prep.options.n)
        self.answers: list[Answer] = []

    async def dispatch(self, i: int, prefer: str | None = None) -> Answer:
        p = self.prep
        rid = self.rid if i == 0 else f"{self.rid}-{i}"
        params = msgspec.structs.replace(p.params, seed=self.seeds[i])
        d = await intake.submit(self.gw, self.request, p, rid, prefer, params)
        self.gw.metrics.choices.inc()
        ans = Answer(p, d, self.arrival, self.gw.metrics, self.gw.token_text, rid)
        self.answers.append(ans)
        return ans

    async def merge(self, stream: bool) -> AsyncIterator[tuple[int, Event]]:
        """Every choice's events as they come, tagged with the choice's index: choice 0's
        at once, the others' once choice 0's first event is in (then its instance holds
        the prompt), all to the end. A failure of any choice cancels the rest and is
        raised."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ans: Answer) -> None:
            try:
                async for e in events(self.client, ans, self.deadline, self.gone, stream):
                    q.put_nowait((i, e))
            except Exception as exc:            # raised by the consumer, below
                q.put_nowait((i, exc))
            else:
                q.put_nowait((i, _DONE))

        tasks = [asyncio.ensure_future(pump(0, self.answers[0]))]
        try:
            live, first = 1, True
            while live:
                i, e = await q.get()
                if isinstance(e, Exception):
                    raise e
                if e is _DONE:
                    live -= 1
                    continue
                if first:
                    first = False
                    for k in range(1, self.prep.options.n):
                        ans = await self.dispatch(k, prefer=self.answers[0].d.instance)
                        tasks.append(asyncio.ensure_future(pump(k, ans)))
                        live += 1
                yield i, e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage(self) -> dict:
        a0 = self.answers[0]
        completion = sum(a.reported or a.counted for a in self.answers)
        u = P.usage(a0.prompt_tokens, completion, a0.cached_tokens)
        spec = [sum(a.spec[k] for a in self.answers) for k in range(3)]
        return u | P.spec_usage(*spec) if spec[0] else u

    def headers(self) -> dict:
        d = self.answers[0].d
        return {"x-pdmesh-path": d.path.value, "x-pdmesh-decode": d.instance}

    async def close(self, reason: str) -> None:
        await close(self.client, self.answers, reason)


async def answer_n(request: web.Request, gw: Gateway, prep: Prepared, rid: str,
                   arrival: float) -> web.StreamResponse:
    """The HTTP answer of a request with n > 1 (JSON or SSE)."""
    ch = Choices(gw, request, prep, rid, arrival)
    access.note(request, ch.answers)          # (filled as the choices are dispatched)
    async with AbortOnExit(gw.client, gw.metrics, ch.answers):
        await ch.dispatch(0)
        if prep.options.stream:
            return await _stream(ch)
        return await _whole(ch)


async def _whole(ch: Choices) -> web.Response:
    async for _ in ch.merge(stream=False):
        pass
    created = int(time.time())
    body = None
    for i, ans in enumerate(ch.answers):
        b = whole_body(ans, ch.rid, created)
        b["choices"][0]["index"] = i
        if body is None:
            body = b
        else:
            body["choices"] += b["choices"]
    body["usage"] = ch.usage()
    return web.Response(body=P.dumps(body), content_type="application/json",
                        headers=ch.headers())


async def _stream(ch: Choices) -> web.StreamResponse:
    resp = sse_response(ch.request, SSE_HEADERS | ch.headers())
    await resp.prepare(ch.request)
    sse = SseStream(resp, ch.prep, ch.rid, int(time.time()))
    try:
        await sse.role(0)
        opened = {0}
        async for i, e in ch.merge(stream=True):
            if i not in opened:
                opened.add(i)
                await sse.role(i)
            await sse.event(e, i)
        if ch.prep.options.include_usage:
            await sse.usage(ch.usage())
    except OpenAIError as e:
        # headers are gone: the error travels as an SSE event, then [DONE]
        ch.gw.metrics.failures.inc(code=e.code or "error")
        await ch.close(e.code or "error")
        await resp.write(P.sse(e.body()))
    await resp.write(P.SSE_DONE)
    await resp.write_eof()
    return resp
