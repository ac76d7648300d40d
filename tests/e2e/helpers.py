"""Small HTTP/NATS helpers for e2e tests (aiohttp client, nats-py)."""
from __future__ import annotations

import json

import aiohttp

from shared import micro


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
    return await micro.total_stats(nats_url, service)
