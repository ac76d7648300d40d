"""Placement does not change output: PD == colocated == the engine alone, token for
token (deterministic mode), greedy and seeded sampling, and PD really moved KV."""
from __future__ import annotations

import asyncio

import aiohttp

from shared.contracts.sampling import SamplingParams

from .conftest import reference_engine
from .helpers import complete, micro_stats, stream_tokens


def cases(prompts):
    out = []
    for i, p in enumerate(prompts[:20]):
        if i % 2 == 0:
            out.append((p, dict(temperature=0.0, max_tokens=12 + i)))
        else:
            out.append((p, dict(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=12 + i)))
    return out


def test_pd_equals_colocated_equals_engine(mesh, tiny_target, tiny_prompts):
    eng = reference_engine(tiny_target)
    todo = cases(tiny_prompts)
    want = [eng.generate([p], SamplingParams(ignore_eos=True, **kw))[0]["token_ids"]
            for p, kw in todo]
    before = asyncio.run(micro_stats(mesh.nats_url, "decode"))

    async def run():
        gate = asyncio.Semaphore(4)      # a few at once: deterministic mode, tokens unchanged
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(60)) as http:
            async def one(prompt, kw, path):
                async with gate:
                    return await complete(http, mesh.url, prompt, path=path, ignore_eos=True,
                                          **kw)
            return await asyncio.gather(*(one(p, kw, path) for p, kw in todo
                                          for path in ("pd", "colocated")))

    got = iter(asyncio.run(run()))
    for (_, kw), w in zip(todo, want):
        for path in ("pd", "colocated"):
            toks, headers = next(got)
            assert headers["x-pdmesh-path"] == path
            assert toks == w, (path, kw)
    after = asyncio.run(micro_stats(mesh.nats_url, "decode"))
    assert after["pd"] - before["pd"] >= 20
    assert after["kv_writes_applied"] > before["kv_writes_applied"]
    prefill = asyncio.run(micro_stats(mesh.nats_url, "prefill"))
    assert prefill["jobs_done"] >= 20 and prefill["kv_bytes"] > 0


def test_concurrent_streams_equal_alone(mesh, tiny_target, tiny_prompts):
    """32 streamed requests at once, mixed lengths, each equal to its output alone."""
    eng = reference_engine(tiny_target)
    reqs = [(tiny_prompts[i % len(tiny_prompts)] * (1 + i % 3),
             dict(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=8 + (i * 5) % 24))
            for i in range(32)]
    want = [eng.generate([p], SamplingParams(ignore_eos=True, **kw))[0]["token_ids"]
            for p, kw in reqs]

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
            return await asyncio.gather(*[stream_tokens(http, mesh.url, p, ignore_eos=True, **kw)
                                          for p, kw in reqs])

    got = asyncio.run(run())
    assert got == want
