"""What /metrics shows of the rest of the mesh: kvstore's tiers and the LayerSplit
prefill ranks, from their nats.micro $SRV.STATS (granted to the gateway:
shared/subjects.SRV_REQUESTS), asked in the background every --metrics-refresh-s seconds
(`MeshStats.run`), so a scrape asks nobody and answers at once. kvstore's hits,
evictions and checksum failures only grow: they are counters (`..._total`), so rate()
over them is right.
"""
from __future__ import annotations

import asyncio
import logging

from shared import micro

log = logging.getLogger("pdmesh.gateway")

KVSTORE_GAUGES = {
    "l2_entries": "KV blocks in kvstore host memory (L2).",
    "l2_bytes": "Bytes in kvstore host memory (L2).",
    "l2_hits": "Blocks served from L2.",
    "l2_evictions": "Blocks evicted from L2 (demoted to L3).",
    "l3_entries": "KV blocks in kvstore disk files (L3).",
    "l3_bytes": "Bytes in kvstore disk files (L3).",
    "l3_hits": "Blocks served from L3.",
    "l3_evictions": "Blocks evicted from L3.",
    "checksum_failures": "L3 blocks whose checksum failed on read (dropped, recomputed).",
    "blocks_rejected": "Write-back blocks whose checksum failed on arrival (not indexed).",
    "prefix_hit_rate": "Leading prefix keys found / looked up.",
}
KVSTORE_COUNTERS = {"l2_hits", "l2_evictions", "l3_hits", "l3_evictions", "checksum_failures",
                    "blocks_rejected"}


def kvstore_series(kv: dict) -> dict:
    """kvstore's STATS -> /metrics series (name -> (help, value))."""
    return {f"pdmesh_kvstore_{k}" + ("_total" if k in KVSTORE_COUNTERS else ""):
            (h, kv[k]) for k, h in KVSTORE_GAUGES.items() if k in kv}


GROUP_GAUGES = {   # LayerSplit, per prefill rank (labelled by instance)
    "group_cached_blocks": "LayerSplit: prefix blocks this prefill rank holds (its layers).",
    "group_cached_bytes": "LayerSplit: bytes of cached prefix KV this rank holds.",
    "group_sent_bytes": "LayerSplit: layer KV this rank sent to other ranks, bytes.",
    "group_recv_bytes": "LayerSplit: layer KV this rank received from other ranks, bytes.",
    "group_wait_s": "LayerSplit: seconds compute waited for a remote layer.",
    "group_transfer_s": "LayerSplit: seconds remote layers were in transfer.",
    "group_hidden_share": "LayerSplit: share of transfer time hidden behind compute.",
}


async def prefill_group_gauges(nc) -> dict:
    """LayerSplit gauges per prefill rank (none without a prefill group)."""
    try:
        found = await micro.stats(nc, "prefill", wait_s=0.3)
    except Exception:  # noqa: BLE001 - no answer: no group gauges
        return {}
    ranks = [i for i in found if i.stats.get("group_size", 0) > 1]
    if not ranks:
        return {}
    return {f"pdmesh_prefill_{k}": (h, {i.instance_id: float(i.stats.get(k, 0)) for i in ranks})
            for k, h in GROUP_GAUGES.items()}


async def kvstore_stats(nc) -> dict:
    """kvstore's micro STATS data (empty when no kvstore answers quickly)."""
    try:
        found = await micro.service_stats(nc, "kvstore", wait_s=0.5, expect=1)
    except Exception:  # noqa: BLE001 - no kvstore: no kvstore gauges
        return {}
    return found[0] if found else {}


class MeshStats:
    """The latest kvstore and prefill-group series, refreshed every `every_s` seconds."""

    def __init__(self, nc_of, every_s: float):
        self.nc_of, self.every_s = nc_of, every_s
        self.series: dict = {}
        self.refreshed = 0          # completed refreshes (tests wait on it)

    async def refresh(self) -> None:
        nc = self.nc_of()
        kv, group = await asyncio.gather(kvstore_stats(nc), prefill_group_gauges(nc))
        self.series = group | kvstore_series(kv)
        self.refreshed += 1

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep the last answer, ask again
                log.debug("mesh stats refresh failed: %r", e)
            await asyncio.sleep(max(0.1, self.every_s))
