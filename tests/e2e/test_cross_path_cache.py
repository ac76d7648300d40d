"""A prefix computed on either path is a cache hit for the next request on either path
(colocated -> PD, PD -> colocated, PD -> PD, colocated -> colocated), on the first try
after start-up: readiness waits for a prefill worker, and a prompt decode computed itself
is written back to kvstore, where prefill finds it. Outputs equal the uncached engine."""
from __future__ import annotations

import asyncio
import inspect
import json

import aiohttp
import pytest

from shared.contracts.sampling import SamplingParams

from .conftest import reference_engine
from .helpers import micro_stats

ORDERS = [("colocated", "pd"), ("pd", "colocated"), ("pd", "pd"), ("colocated", "colocated")]
MAX_TOKENS = 8


async def complete(url: str, prompt: list[int], path: str) -> tuple[list[int], int]:
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "pdmesh_path": path}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            assert r.headers["x-pdmesh-path"] == path
    return (data["choices"][0]["token_ids"],
            data["usage"]["prompt_tokens_details"]["cached_tokens"])


async def stored(nats_url: str, at_least: int) -> None:
    for _ in range(100):
        if (await micro_stats(nats_url, "kvstore")).get("blocks_stored", 0) >= at_least:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the write-back never reached kvstore")


def test_ready_means_pd_is_usable_from_the_first_request(mesh, tiny_tokenizer):
    async def run():
        async with aiohttp.ClientSession() as http:
            async with http.get(mesh.url + "/ready") as r:
                assert r.status == 200, await r.text()
        p = tiny_tokenizer.encode("def first_request_after_start(): return 1")
        body = {"model": "tiny-target", "prompt": p, "max_tokens": 2}   # no forced path
        async with aiohttp.ClientSession() as http:
            async with http.post(mesh.url + "/v1/completions", data=json.dumps(body),
                                 headers={"content-type": "application/json"}) as r:
                assert r.status == 200
                return r.headers["x-pdmesh-path"]

    assert asyncio.run(run()) == "pd"


@pytest.mark.parametrize("first,second", ORDERS, ids=[f"{a}->{b}" for a, b in ORDERS])
def test_a_prefix_computed_on_one_path_hits_on_the_next(mesh, tiny_target, tiny_tokenizer,
                                                        first, second):
    ctx = tiny_tokenizer.encode(f"# {first} then {second}\n" + inspect.getsource(json))[:300]
    a, b = ctx + tiny_tokenizer.encode("\nx = 1"), ctx + tiny_tokenizer.encode("\ny = 2")

    async def run():
        before = (await micro_stats(mesh.nats_url, "kvstore")).get("blocks_stored", 0)
        await complete(mesh.url, a, first)
        if first == "colocated":           # decode's write-back reaches kvstore
            await stored(mesh.nats_url, before + 1)
        return await complete(mesh.url, b, second)

    got, cached = asyncio.run(run())
    assert cached > 0, f"{first} -> {second}: the prefix was computed again"
    want = reference_engine(tiny_target, prefix_cache=False).generate(
        [b], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert got == want["token_ids"]
