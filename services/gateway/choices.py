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
migration after a lost instance (respond.next_chunk) moves only that choice.

The answer: `choices[i].index` = i; a stream interleaves the choices' chunks, each carrying
its index (OpenAI's shape: a role chunk and a finish chunk per choice); usage counts the
prompt once (with choice 0's cached_tokens: what the prompt cost) and sums completions. One
choice failing fails the request (an error status, or an SSE error event once streaming).
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from shared.contracts.messages import TokenChunk

from . import access, intake, protocol as P
from .aborting import AbortOnExit, close
from .protocol import OpenAIError
from .respond import SSE_HEADERS, Answer, SseStream, client_gone, next_chunk, whole_body
from .slowclients import sse_response
from .validate import Prepared

if TYPE_CHECKING:
    from .app import Gateway

_SEEDS = 1 << 64
_rng = random.Random()


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """seed, seed + 1, ... (wrapped into 64 bits: the sampler reads seeds mod 2**64)."""
    s = _rng.getrandbits(63) if seed is None else seed
    return [s + i if s + i < _SEEDS else s + i - _SEEDS for i in range(n)]


class Choice(Answer):
    """One choice's answer; `started` is set once a chunk of it was accounted."""

    def __init__(self, index: int, *args):
        super().__init__(*args)
        self.index = index
        self.started = asyncio.Event()

    def add(self, chunk: TokenChunk):
        out = super().add(chunk)
        self.started.set()
        return out


class Choices:
    """The n choices of one request: dispatch (choice 0 first), relay, abort."""

    def __init__(self, gw: Gateway, request: web.Request, prep: Prepared, rid: str,
                 arrival: float):
        self.gw, self.request, self.prep, self.rid = gw, request, prep, rid
        self.arrival = arrival
        self.client = gw.client
        self.deadline = arrival + self.client.request_timeout_s
        self.gone = client_gone(request)
        self.seeds = choice_seeds(prep.params.seed, prep.options.n)
        self.answers: list[Choice] = []

    async def dispatch(self, i: int, prefer: str | None = None) -> Choice:
        p = self.prep
        rid = self.rid if i == 0 else f"{self.rid}-{i}"
        params = msgspec.structs.replace(p.params, seed=self.seeds[i])
        d = await intake.submit(self.gw, self.request, p, rid, prefer, params)
        self.gw.metrics.choices.inc()
        ans = Choice(i, p, d, self.arrival, self.gw.metrics, self.gw.token_text, rid)
        self.answers.append(ans)
        return ans

    async def run(self, relay) -> None:
        """relay(ans) for every choice: choice 0's at once, the others once choice 0's
        first chunk is in (then its instance holds the prompt), all to the end. Any
        failure cancels the rest and is raised."""
        first = self.answers[0]
        tasks = [asyncio.ensure_future(relay(first))]
        try:
            started = asyncio.ensure_future(first.started.wait())
            await asyncio.wait([tasks[0], started], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            if tasks[0].done() and tasks[0].exception() is not None:
                raise tasks[0].exception()
            for i in range(1, self.prep.options.n):
                ans = await self.dispatch(i, prefer=first.d.instance)
                tasks.append(asyncio.ensure_future(relay(ans)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, ans: Choice) -> None:
        while not ans.d.finished:
            ans.add(await next_chunk(self.client, ans, self.deadline, self.gone))

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
    await ch.run(ch.collect)
    created = int(time.time())
    body = None
    for ans in sorted(ch.answers, key=lambda a: a.index):
        b = whole_body(ans, ch.rid, created)
        b["choices"][0]["index"] = ans.index
        if body is None:
            body = b
        else:
            body["choices"] += b["choices"]
    body["usage"] = ch.usage()
    return web.Response(body=P.dumps(body), content_type="application/json",
                        headers=ch.headers())


class _OneAtATime:
    """The response the choices' SseStreams share: one whole event written at a time."""

    def __init__(self, resp: web.StreamResponse, lock: asyncio.Lock):
        self.resp, self.lock = resp, lock

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await self.resp.write(data)


async def _stream(ch: Choices) -> web.StreamResponse:
    resp = sse_response(ch.request, SSE_HEADERS | ch.headers())
    await resp.prepare(ch.request)
    created, lock = int(time.time()), asyncio.Lock()
    o = ch.prep.options

    async def relay(ans: Choice) -> None:
        await SseStream(_OneAtATime(resp, lock), ans, ch.rid, created, index=ans.index,
                        own_usage=False).relay(ch.client, ch.deadline, ch.gone)

    try:
        await ch.run(relay)
        if o.include_usage:
            await resp.write(P.sse(P.usage_chunk(ch.rid, created, o.model, o.chat, ch.usage())))
    except OpenAIError as e:
        # headers are gone: the error travels as an SSE event, then [DONE]
        ch.gw.metrics.failures.inc(code=e.code or "error")
        await ch.close(e.code or "error")
        await resp.write(P.sse(e.body()))
    await resp.write(P.SSE_DONE)
    await resp.write_eof()
    return resp
