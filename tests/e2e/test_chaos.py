"""Invariant 3 under chaos: no KV slot is reused while a write to it can still land.

A real mesh with a 48-block decode pool, random delays on every KV write, ~40% of 1,000+
requests cancelled by the client at a random moment (right after submit too), abort storms
and a prefill SIGKILLed mid-run: every completed request equals its reference token for
token, and afterwards no block is used or quarantined and every service is healthy.
test_chaos_controls.py runs each guard alone, and neither (the negative controls);
scripts/chaos.py runs any of them at scale (docs/bench/chaos_*)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import nats

from pdmesh.chaos.run import ONE_WRITE, ChaosConfig, headline, run
from pdmesh.local.cluster import Cluster
from shared import micro
from shared.contracts.sampling import SamplingParams
from shared.natsconn import connect_kwargs

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete


def test_chaos_aborts_storms_and_a_killed_prefill_never_corrupt_or_leak(tiny_target):
    res = run(ChaosConfig(model=str(tiny_target), requests=1000, storms=3, storm_size=24))
    _sound_and_chaotic(res)
    assert res["prefill_kv_writes"] > res["claims_granted"]     # layer-wise: several an attempt


def test_chaos_on_the_whole_prompt_path_one_write_per_prompt(tiny_target):
    """The one-host default KV path (no layer-wise streaming): the prompt's KV goes in one
    write that carries its PrefillDone. The same chaos never corrupts or leaks there either."""
    res = run(ChaosConfig(model=str(tiny_target), requests=600, storms=2, storm_size=24,
                          **ONE_WRITE))
    _sound_and_chaotic(res)
    assert 0 < res["prefill_kv_writes"] <= res["claims_granted"]    # one write an attempt


def _sound_and_chaotic(res: dict) -> None:
    print(headline(res))
    assert res["mismatches"] == 0, res["mismatch_samples"]
    assert res["errors"] == 0, res["error_samples"]
    assert res["blocks_leaked"] == 0 and res["requests_left"] == 0, res
    assert res["unhealthy"] == [], res["unhealthy"]
    # the run really was chaotic: many aborts, some while KV writes were in flight
    assert res["client_cancelled"] >= 0.3 * res["requests"]
    assert res["aborts"] >= 0.25 * res["requests"]
    assert res["reclaims_by_outcome"].get("acked", 0) > 0
    assert res["prefill_jobs_reclaimed"] > 0
    assert res["pd"] >= 0.3 * res["requests"]


def test_reclaim_stops_writes_and_a_dead_owner_is_covered_by_the_lease(tiny_target,
                                                                        tiny_prompts):
    """Abort while prefill holds the job: ReclaimAck at once, no write is ever issued.
    Abort after the owner was SIGKILLed: the blocks stay quarantined until the lease ends;
    the job, redelivered to the restarted worker, is refused before it computes."""
    prefill = det_overrides()["prefill"] | {"fault_delay_before_kv_s": 3.0, "ack_wait_s": 2.0}
    decode = det_overrides(mode="pd", reclaim_lease_s=3.0)["decode"]
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET,
                 overrides={"decode": decode, "prefill": prefill}, echo=False) as c:
        prompt, params = tiny_prompts[2], dict(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def until(service: str, pred, timeout_s: float = 30.0) -> dict:
            deadline = time.monotonic() + timeout_s
            while True:
                st = await stats(c.nats_url, service)
                if st and pred(st):
                    return st
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.2)

        async def run():
            async with aiohttp.ClientSession() as http:
                # 1. the owner is alive: it stops before its first write and acks at once
                req = asyncio.ensure_future(complete(http, c.url, prompt, **params))
                await until("decode", lambda s: s["claims_granted"] == 1)
                req.cancel()
                st = await until("decode", lambda s: s["reclaims"] == 1)
                assert st["reclaims_by_outcome"] == {"acked": 1}
                pre = await until("prefill", lambda s: s["jobs_reclaimed"] == 1)
                assert pre["kv_writes"] == 0 and pre["reclaims_answered"] == 1
                # 2. the owner is dead: quarantined until the lease, then free
                req = asyncio.ensure_future(complete(http, c.url, prompt, **params))
                await until("decode", lambda s: s["claims_granted"] == 2)
                c.kill("prefill-0")
                req.cancel()
                st = await until("decode", lambda s: s["requests_quarantined"] == 1)
                assert st["blocks_quarantined"] > 0
                st = await until("decode", lambda s: s["reclaims"] == 2, timeout_s=15)
                assert st["reclaims_by_outcome"] == {"acked": 1, "lease": 1}
                assert st["blocks_quarantined"] == 0 and st["blocks_used"] == 0
                # 3. the redelivered job is refused; the mesh serves on
                await c.arestart("prefill-0")
                pre = await until("prefill", lambda s: s["jobs_refused"] == 1)
                assert pre["jobs_redelivered"] == 1 and pre["kv_writes"] == 0
                assert (await stats(c.nats_url, "decode"))["claims_refused"] == 1
                return await complete(http, c.url, prompt, **params)

        (got, headers) = asyncio.run(run())
        want = reference_engine(tiny_target).generate(
            [prompt], SamplingParams(**params))[0]["token_ids"]
        assert got == want and headers["x-pdmesh-path"] == "pd"


async def stats(nats_url: str, service: str) -> dict:
    """The STATS data of the (single) instance of a service, nested values included."""
    nc = await nats.connect(**connect_kwargs(nats_url))    # the URL's user, its inbox
    try:
        found = await micro.stats(nc, service, wait_s=0.2)
    finally:
        await nc.close()
    return found[0].stats if found else {}
