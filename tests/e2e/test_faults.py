"""Process and server failures: an accepted request completes or gets an explicit error
within seconds, never hangs."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete, micro_stats, sse_events

CHAT = {"model": "tiny-target", "messages": [{"role": "user", "content": "Write code."}]}


def test_decode_killed_mid_stream_gives_error_event_fast(tiny_target):
    with Cluster(str(tiny_target), prefill=0, decode=1, **DET, overrides=det_overrides(),
                 echo=False) as c:
        async def run():
            async with aiohttp.ClientSession() as http:
                async with http.post(c.url + "/v1/chat/completions", json=CHAT | {
                        "stream": True, "max_tokens": 3000, "ignore_eos": True}) as r:
                    assert r.status == 200
                    n, t_kill, error = 0, None, None
                    async for chunk in sse_events(r):
                        if "error" in chunk:
                            error = chunk["error"]
                            break
                        n += 1
                        if n == 3:
                            c.kill("decode-0")
                            t_kill = time.monotonic()
                    return error, time.monotonic() - t_kill

        error, waited = asyncio.run(asyncio.wait_for(run(), 60))
        assert error is not None and error["message"]
        assert waited < 10


def test_prefill_killed_with_job_in_flight_job_is_redelivered(tiny_target, tiny_prompts):
    prefill = det_overrides()["prefill"] | {"fault_delay_before_kv_s": 4.0, "ack_wait_s": 2.0}
    # decode waits for the redelivery: a restart under a full suite's load once took longer
    # than the default prefill_timeout_s (30 s), and decode prefilled the request itself
    decode = det_overrides(mode="pd", prefill_timeout_s=120.0)
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET,
                 overrides=decode | {"prefill": prefill}, echo=False) as c:
        prompt = tiny_prompts[3]

        async def run():
            async with aiohttp.ClientSession() as http:
                req = asyncio.ensure_future(complete(http, c.url, prompt, temperature=0.0,
                                                     max_tokens=10, ignore_eos=True))
                await asyncio.sleep(2.0)           # the job is computed, its KV not yet sent
                c.kill("prefill-0")                # SIGKILL: the job is never acked
                await c.arestart("prefill-0")      # a fresh worker gets the redelivery
                return await asyncio.wait_for(req, 90)

        got, headers = asyncio.run(run())
        want = reference_engine(tiny_target).generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]["token_ids"]
        assert got == want and headers["x-pdmesh-path"] == "pd"
        dec = asyncio.run(micro_stats(c.nats_url, "decode"))
        assert dec["prefill_fallbacks"] == 0
        pre = asyncio.run(micro_stats(c.nats_url, "prefill"))
        assert pre["jobs_done"] == 1      # done by the restarted worker, after redelivery


def test_nats_restart_while_idle_mesh_serves_again(tiny_target):
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=det_overrides(),
                 echo=False) as c:
        async def ask(http):
            async with http.post(c.url + "/v1/chat/completions",
                                 json=CHAT | {"max_tokens": 4}) as r:
                return r.status

        async def run():
            async with aiohttp.ClientSession() as http:
                assert await ask(http) == 200
                await c.arestart_nats(down_s=1.0)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if await ask(http) == 200:
                        return True
                    await asyncio.sleep(0.5)
                return False

        assert asyncio.run(run())
        assert not c.unexpected_exits()
