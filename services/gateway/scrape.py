"""What /metrics reads from the rest of the mesh at each scrape: kvstore's tier gauges and
the LayerSplit prefill ranks' gauges, from their nats.micro $SRV.STATS (granted to the
gateway: shared/subjects.SRV_REQUESTS)."""
from __future__ import annotations

from shared import micro

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
