"""Speculative decoding over the real mesh: with the draft on decode, greedy output over
PD and colocated paths equals the plain engine's (no draft), token for token, and the
response reports the acceptance statistics."""
from __future__ import annotations

import asyncio

import aiohttp

from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine


def test_greedy_speculative_equals_plain_pd_and_colocated(tiny_target, tiny_draft, tiny_prompts,
                                                          tiny_tokenizer):
    chat = [tiny_tokenizer.encode(t) for t in (
        "User: hello, how are you?\nAssistant:", "User: what is a list in python?\nAssistant:",
        "User: tell me about the weather today\nAssistant:")]
    prompts = (tiny_prompts + chat)[:22]
    assert len(prompts) >= 20
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [r["token_ids"] for r in reference_engine(tiny_target).generate(prompts, sp)]
    ov = det_overrides(draft_model=str(tiny_draft), num_speculative_tokens=4)
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=ov, echo=False) as mesh:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
                async def one(p, path):
                    body = {"model": "tiny-target", "prompt": p, "max_tokens": 24,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                            "pdmesh_path": path}
                    async with http.post(mesh.url + "/v1/completions", json=body) as r:
                        data = await r.json()
                        assert r.status == 200, data
                        return data["choices"][0]["token_ids"], data["usage"]
                out = {}
                for path in ("pd", "colocated"):   # concurrent: speculation inside batches
                    out[path] = await asyncio.gather(*(one(p, path) for p in prompts))
                return out
        out = asyncio.run(go())
    for path, res in out.items():
        got = [toks for toks, _ in res]
        assert got == want, path
        lengths = [u["spec_accept_length"] for _, u in res if "spec_accept_length" in u]
        assert len(lengths) == len(prompts), f"{path}: usage lacks spec_accept_length"
        assert all(1.0 <= x <= 5.0 for x in lengths)
