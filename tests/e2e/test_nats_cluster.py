"""The whole mesh on a three-node NATS cluster (issue 13): it serves, and a node SIGKILLed
while 16 greedy requests are in flight costs none of them (every output equals the engine
alone). The node killed is the one decode is connected to (decode's $SRV.STATS says
which), so decode's own connection fails over, not only JetStream's leaders."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdmesh.local.cluster import Cluster
from shared import micro
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 24


def _node_of(c: Cluster, server: str) -> str:
    port = int(server.rsplit(":", 1)[1])
    return next(n.name for n in c.nats.nodes if n.port == port)


async def _decode_stats_after_failover(c: Cluster, deadline_s: float = 60.0) -> dict:
    """Decode's $SRV.STATS once it answers again: right after a node dies, decode's
    subscriptions are re-sent to a surviving node and the routes learn the interest, so
    one 0.5 s collection window can come back empty on a loaded machine."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        answers = await micro.service_stats(c.nats_url, "decode", wait_s=2.0, expect=1)
        if answers or loop.time() > end:
            assert answers, "decode never answered $SRV.STATS after the node died"
            return answers[0]
        await asyncio.sleep(0.5)


def test_three_node_nats_serves_and_loses_nothing_when_a_node_dies(tiny_target, tiny_prompts):
    prompts = tiny_prompts[:16]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o["token_ids"] for o in reference_engine(tiny_target).generate(prompts, params)]
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, nats_cluster=3,
                 overrides=det_overrides(mode="pd"), echo=False) as c:
        assert c.nats_names() == ["nats-0", "nats-1", "nats-2"]

        async def run():
            async with aiohttp.ClientSession() as http:
                got, _ = await complete(http, c.url, prompts[0], temperature=0.0,
                                        max_tokens=MAX_TOKENS, ignore_eos=True)
                assert got == want[0]                  # the cluster serves
                reqs = [asyncio.ensure_future(complete(
                    http, c.url, p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
                    for p in prompts]
                decode = {}
                while not decode.get("running"):        # requests are in flight on decode
                    answers = await micro.service_stats(c.nats_url, "decode", expect=1)
                    decode = answers[0] if answers else {}
                    await asyncio.sleep(0.05)
                victim = _node_of(c, decode["nats_server"])
                c.kill(victim)
                results = await asyncio.wait_for(
                    asyncio.gather(*reqs, return_exceptions=True), 180)
                return victim, results, await _decode_stats_after_failover(c)

        victim, results, after = asyncio.run(run())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, failed[:3]
        assert [r[0] for r in results] == want
        assert after["nats_server"] and _node_of(c, after["nats_server"]) != victim
        assert c.unexpected_exits() == []
