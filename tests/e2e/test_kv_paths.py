"""KV between real processes on one host: prefill streams each layer's KV while the
prompt computes and, decode heartbeating the same host, writes it through shared memory
(NATS carries the handles); outputs equal the engine alone, PD and colocated alike."""
from __future__ import annotations

import asyncio

import aiohttp

from pdmesh.local.cluster import Cluster

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete, micro_stats


def test_streamed_shared_memory_kv_gives_the_engines_output(tiny_target, tiny_prompts):
    from shared.contracts.sampling import SamplingParams

    eng = reference_engine(tiny_target)
    prompts = [(tiny_prompts[i] * 12)[:150 + 13 * i] for i in range(6)]   # 5..7 chunks
    want = [eng.generate([p], SamplingParams(temperature=0.0, max_tokens=6,
                                             ignore_eos=True))[0]["token_ids"] for p in prompts]
    ov = det_overrides()
    ov["prefill"] |= {"kv_stream": "on", "kv_stream_shm": True}   # streamed, through shm too
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=ov,
                 echo=False) as c:
        async def run():
            await asyncio.sleep(2.0)      # a decode heartbeat tells prefill decode's host
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
                got = [(await complete(http, c.url, p, path="pd", max_tokens=6,
                                       temperature=0.0, ignore_eos=True))[0] for p in prompts]
                colo = [(await complete(http, c.url, p, path="colocated", max_tokens=6,
                                        temperature=0.0, ignore_eos=True))[0]
                        for p in prompts[:2]]
            return got, colo, await micro_stats(c.nats_url, "prefill")

        got, colo, pre = asyncio.run(run())
    assert got == want and colo == want[:2]
    assert pre["kv_writes_streamed"] > 0                  # layers left during the compute
    assert pre["kv_shm_writes"] > 0 and pre["kv_shm_fallbacks"] == 0
