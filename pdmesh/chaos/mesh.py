"""The chaos run's mesh (pdmesh/chaos/run.py): how it is started (the guard switches, the
write delays, the small pool), and what is asked of it during and after the load: a prefill
with KV writes in flight, quiescence, health."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from shared import micro
from shared.natsconn import connect_kwargs

if TYPE_CHECKING:
    from pdmesh.chaos.run import ChaosConfig

# prefill and decode share every shape-affecting engine setting (batch-invariant logits)
DET = dict(deterministic=True, dtype="float32", threads=1)
SHAPES = {"max_num_batched_tokens": 128, "chunk_size": 32, "block_size": 16}


def cluster(cfg: ChaosConfig):
    from pdmesh.local.cluster import Cluster
    from shared.faults import ALLOW_ENV

    # admission control is not what this run tests: no 429 for the storms on top of the load
    gateway = {"max_in_flight": 100_000}
    decode = SHAPES | {"max_num_seqs": 16, "mode": "pd", "num_blocks": cfg.num_blocks,
                       "max_queued": 100_000,
                       "reclaim_lease_s": cfg.lease_s, "reclaim_timeout_s": 0.5,
                       "fault_no_reclaim_ack": not cfg.reclaim_ack,
                       "fault_no_epoch_fence": not cfg.epoch_fence}
    # layer-wise streaming on by default: the path with the most writes in flight when
    # aborts land; off, the default whole-prompt path (through shared memory, one host)
    prefill = SHAPES | {"ack_wait_s": 3.0, "max_num_seqs": 8, "kv_window": cfg.kv_window,
                        "kv_stream": "on" if cfg.kv_stream else "off",
                        "kv_stream_shm": cfg.kv_stream,
                        "kv_max_write_bytes": cfg.kv_max_write_bytes,
                        "fault_kv_write_delay_s": cfg.write_delay_s}
    return Cluster(cfg.model, prefill=cfg.prefill, decode=1, kvstore=False, **DET,
                   overrides={"gateway": gateway, "decode": decode, "prefill": prefill},
                   echo=cfg.echo, log_dir=cfg.log_dir,
                   extra_env={ALLOW_ENV: "1"})   # the guard switches


async def wait_writing(nats_url: str, instance_id: str, within_s: float) -> int:
    """Until the prefill instance has KV writes in flight (or within_s passed); how many."""
    import nats

    nc = await nats.connect(**connect_kwargs(nats_url))   # the URL's user, its own inbox
    try:
        deadline = time.monotonic() + within_s
        while True:
            for i in await micro.stats(nc, "prefill", wait_s=0.05):
                n = i.stats.get("kv_writes_in_flight", 0)
                if i.instance_id == instance_id and n > 0:
                    return n
            if time.monotonic() > deadline:
                return 0
    finally:
        await nc.close()


async def decode_stats(nats_url: str, prefill: int) -> dict:
    import nats

    nc = await nats.connect(**connect_kwargs(nats_url))
    try:
        return {"decode": await micro.service_stats(nc, "decode", expect=1),
                "prefill": await micro.service_stats(nc, "prefill", expect=prefill or None)}
    finally:
        await nc.close()


async def quiesce(cfg: ChaosConfig, nats_url: str) -> dict:
    """Until decode holds no request, no quarantined block and no used block (or timeout)."""
    deadline = time.monotonic() + cfg.quiesce_s + cfg.lease_s
    while True:
        st = await decode_stats(nats_url, cfg.prefill)
        d = st["decode"]
        total = micro.sum_stats(d)
        busy = sum(total.get(k, 0) for k in ("requests", "requests_live", "awaiting_kv",
                                              "blocks_used", "blocks_quarantined",
                                              "requests_quarantined"))
        if (d and busy == 0) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.5)


async def healthy(c) -> list[str]:
    """Problems: gateway /health, an instance missing from $SRV.PING, a child that died."""
    import aiohttp

    problems = [f"{p.name} exited ({p.returncode})" for p in c.unexpected_exits()]
    async with aiohttp.ClientSession() as http:
        async with http.get(c.url + "/health") as r:
            if r.status != 200:
                problems.append(f"gateway /health {r.status}: {await r.text()}")
    nc = await micro.connect_once(c.nats_url)
    try:
        seen = {(i.service, i.instance_id) for i in await micro.ping(nc)}
    finally:
        await nc.close()
    for p in c.procs.values():
        if p.service != "nats" and (p.service, p.instance_id) not in seen:
            problems.append(f"{p.name} does not answer $SRV.PING")
    return problems
