"""A gateway handing its port to a successor (handover.py), over real HTTP: every response from
the hand-over on says `Connection: close` in its header, so that a keep-alive client never
sends its next request on a connection the gateway is about to close (issue 28: the header
was missing, and 4-9 of 48 requests of a rolling restart were reset)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from services.gateway.handover import Handover


async def _serve(handover: Handover):
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def plain(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[handover.middleware])
    app.on_response_prepare.append(handover.on_prepare)
    app.router.add_post("/stream", stream)
    app.router.add_post("/plain", plain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/stream", "/plain"])
async def test_after_the_handover_every_answer_says_connection_close(path):
    handover = Handover()
    runner, url = await _serve(handover)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + path, json={}) as r:
                await r.read()
                assert r.headers.get("Connection") != "close"     # keep-alive as usual
            handover.begin()
            # back to back on one pool, as a load generator's worker does: the server closes
            # each connection after its answer, so the header must have told the client
            for _ in range(20):
                async with http.post(url + path, json={}) as r:
                    await r.read()
                    assert r.status == 200
                    assert r.headers.get("Connection") == "close"
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_an_answer_begun_before_the_handover_keeps_its_connection_open():
    """A response whose header promised keep-alive is not followed by a close: the client's
    next request on that connection is served (with `Connection: close`)."""
    handover = Handover()
    runner, url = await _serve(handover)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
            async with http.post(url + "/stream", json={}) as r:
                assert r.headers.get("Connection") != "close"
                handover.begin()                                  # mid-stream
                await r.read()
            async with http.post(url + "/plain", json={}) as r:   # the same connection
                assert r.status == 200
                assert r.headers.get("Connection") == "close"
    finally:
        await runner.cleanup()
