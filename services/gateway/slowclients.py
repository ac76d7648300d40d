"""What a slow or idle client may hold of the gateway: nothing it does not use, and
nothing past a deadline (issue 29: 64 sockets that each sent one body byte gave every
other tenant 429 for as long as they stayed open; SSE clients that never read held their
slots for minutes after decode had finished).

    read_body   the body within --body-timeout-s (408 after), before anything is counted
    Slots       in flight is counted only once the body is read and parsed, under the
                global cap and a per-key cap (one tenant cannot fill the gateway)
    SseResponse every write to the client within --write-timeout-s; past it the client is
                gone (ClientGone: decode is told to abort, the slot is freed)
"""
from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from .chunks import ClientGone
from .protocol import OpenAIError, overloaded


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 when the client has not sent it within timeout_s."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g}s "
                               "(--body-timeout-s)", code="request_timeout") from None


class Slots:
    """Requests in flight, in all and per API key (tenant)."""

    def __init__(self):
        self.total = 0
        self.by_key: Counter = Counter()

    def take(self, key: str, cap: int, key_cap: int) -> None:
        """Count one more request for key, or raise 429 (Retry-After) past either cap. The
        anonymous key "" (no API keys configured) is held to the global cap only."""
        if cap and self.total >= cap:
            raise overloaded(f"{self.total} requests in flight (limit {cap})")
        if key and key_cap and self.by_key[key] >= key_cap:
            raise overloaded(f"{self.by_key[key]} requests in flight for this API key "
                             f"(limit {key_cap} per key)")
        self.total += 1
        self.by_key[key] += 1

    def give(self, key: str) -> None:
        self.total -= 1
        self.by_key[key] -= 1
        if self.by_key[key] <= 0:
            del self.by_key[key]


def key_cap(cap: int, configured: int) -> int:
    """Per-key cap: the configured one, else half the global cap (at least 1)."""
    return configured or (max(1, cap // 2) if cap else 0)


class SseResponse(web.StreamResponse):
    """A streamed response whose every write must reach the client's socket within
    timeout_s: aiohttp's write waits for the transport to drain, which a client that
    stopped reading never lets happen. Past the deadline the connection is closed and
    ClientGone raised, as for a client that disconnected."""

    def __init__(self, *, timeout_s: float, **kw):
        super().__init__(**kw)
        self.timeout_s = timeout_s

    async def write(self, data) -> None:
        try:
            await asyncio.wait_for(super().write(data), self.timeout_s)
        except asyncio.TimeoutError:
            self.force_close()
            transport = self._req.transport if self._req is not None else None
            if transport is not None:
                transport.abort()
            raise ClientGone(f"the client read nothing for {self.timeout_s:g}s "
                             "(--write-timeout-s)") from None


WRITE_TIMEOUT = web.AppKey("write_timeout_s", float)     # create_app sets it


def sse_response(request: web.Request, headers: dict) -> SseResponse:
    """A streamed response with the app's write deadline (--write-timeout-s)."""
    return SseResponse(timeout_s=request.app.get(WRITE_TIMEOUT, 30.0), headers=headers)
