"""Handing the port to a successor (`pdmesh restart gateway`): pdmesh up owns the listening
socket and passes it to each gateway it starts (listen_fd); the successor accepts from it
beside this one, this one stops accepting (its copy closed, the socket and its backlog
live on), and no client request fails.

HTTP/1.1 keep-alive makes it delicate: a client may send its next request on a connection
it holds the moment this gateway closes that connection, and a POST is not retried (closing
the idle ones at once failed 6-16 of 48 requests in a rolling restart under 16 streams). So,
from `begin()` on, no connection is closed under a client: every response says `Connection:
close` in its header and closes its connection after it; a response begun before keeps its
connection open (its header promised keep-alive), and a request that still arrives on such
a connection is served and its answer closes it. The gateway drains until no request has
been served for QUIET_S; only connections idle since then are still open, and closed.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiohttp import hdrs, web

QUIET_S = 0.5


class Handover:
    def __init__(self):
        self.on = False
        self.busy: Counter = Counter()       # connection (protocol) -> requests it is serving
        self.last_request = 0.0              # monotonic: when a request last ended

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = request.protocol
        self.busy[conn] += 1
        try:
            return await handler(request)
        finally:
            self.busy[conn] -= 1
            if not self.busy[conn]:
                del self.busy[conn]
            self.last_request = time.monotonic()

    async def on_prepare(self, _request: web.Request, response: web.StreamResponse) -> None:
        """Say `Connection: close` in the header, not only close after: aiohttp computes the
        header before this signal, so force_close() alone closed a connection whose client
        had been told keep-alive, and had its next request on it reset (issue 28: 4-9 of 48
        in a rolling restart)."""
        if self.on:
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    def begin(self) -> None:
        """Hand over: from now on every response closes its connection."""
        self.on = True

    async def settle(self, deadline: float) -> None:
        """Until no request is being served and none has ended for QUIET_S (or deadline)."""
        while time.monotonic() < deadline:
            if not self.busy and time.monotonic() - self.last_request >= QUIET_S:
                return
            await asyncio.sleep(0.05)
