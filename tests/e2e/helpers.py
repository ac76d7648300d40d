"""Small HTTP/NATS helpers for e2e tests (aiohttp client, nats-py)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import nats


def body(prompt_ids, path=None, **kw) -> dict:
    b = {"model": "tiny-target", "prompt": prompt_ids, "return_token_ids": True, **kw}
    if path:
        b["pdmesh_path"] = path
    return b


async def complete(http: aiohttp.ClientSession, url: str, prompt_ids, path=None, **kw):
    async with http.post(url + "/v1/completions", json=body(prompt_ids, path, **kw)) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["token_ids"], r.headers


async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON events of an SSE response, up to [DONE]."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        yield json.loads(line[6:])


async def stream_tokens(http: aiohttp.ClientSession, url: str, prompt_ids, path=None,
                        **kw) -> list[int]:
    toks: list[int] = []
    async with http.post(url + "/v1/completions",
                         json=body(prompt_ids, path, stream=True, **kw)) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_events(r):
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                toks += ch.get("token_ids") or []
    return toks


async def micro_stats(nats_url: str, service: str) -> dict:
    """Sum over every instance of the service's STATS data."""
    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    replies = []

    async def cb(msg):
        replies.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=cb)
    await nc.publish(f"$SRV.STATS.{service}", b"", reply=inbox)
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    await nc.close()
    total: dict = {}
    for r in replies:
        data = r["endpoints"][0].get("data") or {}
        for k, v in data.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total
