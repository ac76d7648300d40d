"""What /metrics shows of the rest of the mesh: every decode, prefill and kvstore
instance's nats.micro $SRV.STATS (granted to the gateway: shared/subjects.SRV_REQUESTS),
asked in the background every --metrics-refresh-s seconds (`MeshStats.run`), so a scrape
asks nobody and answers at once. The gateway federates them, labelled by `service` and
`instance` (as Prometheus federation would), so one scrape target shows the whole mesh:

    pdmesh_decode_claims_refused_total{service="decode",instance="decode_0"} 3.0

What only grows is a counter (`..._total`), so rate() over it is right. `federate()` is
the pure part (STATS in, series out); README.md "Metrics and tracing" lists them.
"""
from __future__ import annotations

import asyncio
import logging

from shared import micro
from shared.contracts.messages import AbortReason

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

# STATS key -> (series, help): one sample per instance, labelled service and instance
COUNTERS = {
    "decode": {
        "pd": ("pdmesh_decode_requests_pd_total", "Requests this decode served by PD."),
        "colocated": ("pdmesh_decode_requests_colocated_total",
                      "Requests this decode prefilled itself (colocated)."),
        "claims_granted": ("pdmesh_decode_claims_granted_total",
                           "Prefill claims on this decode's reserved blocks, granted."),
        "claims_refused": ("pdmesh_decode_claims_refused_total",
                           "Prefill claims refused (request aborted or finished, or the claim "
                           "named another reservation)."),
        "kv_writes_applied": ("pdmesh_decode_kv_writes_applied_total",
                              "Remote KV writes that landed in reserved blocks."),
        "kv_writes_fenced": ("pdmesh_decode_kv_writes_fenced_total",
                             "Remote KV writes refused (stale epoch, not the owner, or a "
                             "reservation being reclaimed)."),
        "kv_bytes": ("pdmesh_decode_kv_received_bytes_total",
                     "Remote KV bytes landed in this decode's blocks."),
        "kv_loaded_bytes": ("pdmesh_decode_kv_loaded_bytes_total",
                            "Prefix KV bytes loaded from kvstore (L2/L3) into the engine."),
        "prefill_fallbacks": ("pdmesh_decode_prefill_fallbacks_total",
                              "PD requests prefilled here after their prefill failed."),
    },
    "prefill": {
        "jobs_done": ("pdmesh_prefill_jobs_done_total", "Prefill jobs completed."),
        "jobs_failed": ("pdmesh_prefill_jobs_failed_total", "Prefill jobs that failed."),
        "jobs_refused": ("pdmesh_prefill_jobs_refused_total",
                         "Prefill jobs whose claim decode refused."),
        "jobs_redelivered": ("pdmesh_prefill_jobs_redelivered_total",
                             "Prefill jobs JetStream delivered again."),
        "kv_transfer_s": ("pdmesh_prefill_kv_transfer_seconds_total",
                          "Seconds spent sending KV to decode."),
        "kv_shm_fallbacks": ("pdmesh_prefill_kv_shm_fallbacks_total",
                             "Same-host KV writes that fell back to NATS."),
        "reclaims_answered": ("pdmesh_prefill_reclaims_answered_total",
                              "Reclaim requests answered (this worker's writes accounted for)."),
        "attempts_cancelled": ("pdmesh_prefill_attempts_cancelled_total",
                               "Prefill attempts cancelled (decode aborted the request)."),
        "kv_loaded_bytes": ("pdmesh_prefill_kv_loaded_bytes_total",
                            "Prefix KV bytes loaded from kvstore (L2/L3) into the engine."),
    },
}
GAUGES = {
    "decode": {
        "running": ("pdmesh_decode_instance_running", "Requests in the decode batch."),
        "waiting": ("pdmesh_decode_instance_waiting", "Requests waiting for the batch."),
        "awaiting_kv": ("pdmesh_decode_awaiting_kv", "PD requests whose KV is still coming."),
        "requests_quarantined": ("pdmesh_decode_requests_quarantined",
                                 "Requests whose old reservation is being reclaimed."),
        "blocks_quarantined": ("pdmesh_decode_blocks_quarantined",
                               "KV blocks kept out of the pool until reclaimed."),
        "blocks_used": ("pdmesh_decode_blocks_used", "KV blocks in use."),
        "blocks_free": ("pdmesh_decode_blocks_free", "KV blocks free."),
    },
    "prefill": {
        "jobs_active": ("pdmesh_prefill_jobs_active", "Prefill jobs running."),
        "attempts_open": ("pdmesh_prefill_attempts_open", "Prefill attempts not yet closed."),
        "kv_writes_in_flight": ("pdmesh_prefill_kv_writes_in_flight",
                                "KV writes sent and not yet acknowledged."),
    },
}
# STATS key holding {label value: count} -> (series, label, help, values shown from 0)
BY_LABEL = {
    "decode": {
        "reclaims_by_outcome": ("pdmesh_decode_reclaims_total", "outcome",
                                "Reservations returned to the pool, by how (acked, lease, "
                                "unclaimed).", ("unclaimed", "acked", "lease")),
        "aborts_by_reason": ("pdmesh_decode_aborts_total", "reason", "Requests aborted.",
                             tuple(r.value for r in AbortReason)),
    },
}
ANOMALY_RULES = ("high_accept_rate", "low_accept_length", "repetition")

GROUP_GAUGES = {   # LayerSplit, per prefill rank (labelled by instance)
    "group_cached_blocks": "LayerSplit: prefix blocks this prefill rank holds (its layers).",
    "group_cached_bytes": "LayerSplit: bytes of cached prefix KV this rank holds.",
    "group_sent_bytes": "LayerSplit: layer KV this rank sent to other ranks, bytes.",
    "group_recv_bytes": "LayerSplit: layer KV this rank received from other ranks, bytes.",
    "group_wait_s": "LayerSplit: seconds compute waited for a remote layer.",
    "group_transfer_s": "LayerSplit: seconds remote layers were in transfer.",
    "group_hidden_share": "LayerSplit: share of transfer time hidden behind compute.",
}


def kvstore_series(kv: dict) -> dict:
    """kvstore's STATS -> /metrics series (name -> (help, value))."""
    return {f"pdmesh_kvstore_{k}" + ("_total" if k in KVSTORE_COUNTERS else ""):
            (h, kv[k]) for k, h in KVSTORE_GAUGES.items() if k in kv}


def group_series(prefill: list[micro.Instance]) -> dict:
    """LayerSplit gauges per prefill rank (none without a prefill group)."""
    ranks = [i for i in prefill if i.stats.get("group_size", 0) > 1]
    return {f"pdmesh_prefill_{k}": (h, {i.instance_id: float(i.stats.get(k, 0)) for i in ranks})
            for k, h in GROUP_GAUGES.items()} if ranks else {}


class _Series:
    """name -> (help, {((label, value), ...): number}), filled sample by sample."""

    def __init__(self):
        self.out: dict = {}

    def add(self, name: str, help_: str, labels: tuple, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.out.setdefault(name, (help_, {}))[1][labels] = float(value)


def federate(found: dict[str, list[micro.Instance]], model_name: str) -> dict:
    """Every decode and prefill instance's STATS -> labelled series; kvstore's tiers;
    the prefix cache per tier; vLLM's cache_config_info per decode instance."""
    s = _Series()
    for service in ("decode", "prefill"):
        for i in found.get(service, []):
            at = (("instance", i.instance_id), ("service", service))
            st = i.stats
            for table in (COUNTERS, GAUGES):
                for key, (name, help_) in table.get(service, {}).items():
                    s.add(name, help_, at, st.get(key))
            for key, (name, label, help_, known) in BY_LABEL.get(service, {}).items():
                counts = dict.fromkeys(known, 0) | (st.get(key) or {})
                for value, n in sorted(counts.items()):
                    s.add(name, help_, (*at, (label, str(value))), n)
            if service == "prefill":
                _per_path(s, at, st)
            s.add("pdmesh_prefix_cache_queries_blocks_total",
                  "Prompt blocks looked up in a prefix cache, by service.", at,
                  st.get("l1_query_blocks"))
            s.add("pdmesh_prefix_cache_hits_blocks_total",
                  "Prompt blocks found in a prefix cache, by service and tier.",
                  (*at, ("tier", "l1")), st.get("l1_hit_blocks"))
            if service == "decode":
                for rule in ANOMALY_RULES:
                    s.add("pdmesh_decode_anomalies_total", "Requests the monitor aborted, "
                          "by rule.", (*at, ("rule", rule)), st.get(f"anomaly_{rule}"))
                s.add("vllm:cache_config_info", "Information of the KV cache configuration.",
                      (("block_size", str(st.get("block_size", ""))), *at,
                       ("model_name", model_name),
                       ("num_gpu_blocks", str(st.get("blocks_total", "")))), 1)
    for i in found.get("kvstore", []):
        at = (("instance", i.instance_id), ("service", "kvstore"))
        s.add("pdmesh_prefix_cache_queries_blocks_total",
              "Prompt blocks looked up in a prefix cache, by service.", at,
              i.stats.get("lookup_keys"))
        for tier in ("l2", "l3"):
            s.add("pdmesh_prefix_cache_hits_blocks_total",
                  "Prompt blocks found in a prefix cache, by service and tier.",
                  (*at, ("tier", tier)), i.stats.get(f"{tier}_hits"))
    kv = found.get("kvstore") or []
    return s.out | group_series(found.get("prefill", [])) | kvstore_series(
        kv[0].stats if kv else {})


def _per_path(s: _Series, at: tuple, st: dict) -> None:
    """A prefill worker's KV writes and bytes by transport (same-host shared memory or
    NATS)."""
    if "kv_bytes" not in st:
        return
    shm_b, shm_w = st.get("kv_shm_bytes", 0), st.get("kv_shm_writes", 0)
    for transport, b, w in (("shm", shm_b, shm_w),
                            ("nats", st["kv_bytes"] - shm_b, st.get("kv_writes", 0) - shm_w)):
        s.add("pdmesh_prefill_kv_sent_bytes_total", "KV bytes sent to decode, by transport.",
              (*at, ("transport", transport)), b)
        s.add("pdmesh_prefill_kv_writes_total", "KV writes sent to decode, by transport.",
              (*at, ("transport", transport)), w)


async def _quiet(asked) -> list[micro.Instance]:
    try:
        return await asked
    except Exception:  # noqa: BLE001 - no answer: none of its series this time
        return []


class MeshStats:
    """The latest federated series, refreshed every `every_s` seconds."""

    def __init__(self, nc_of, every_s: float, model_name: str = "pdmesh",
                 decode_count=lambda: None):
        """decode_count(): decode instances alive (stop waiting once all answered)."""
        self.nc_of, self.every_s, self.model_name = nc_of, every_s, model_name
        self.decode_count = decode_count
        self.series: dict = {}
        self.refreshed = 0          # completed refreshes (tests wait on it)

    async def refresh(self) -> None:
        nc = self.nc_of()
        kv, decode, prefill = await asyncio.gather(
            _quiet(micro.stats(nc, "kvstore", wait_s=0.5, expect=1)),
            _quiet(micro.stats(nc, "decode", wait_s=0.5, expect=self.decode_count())),
            _quiet(micro.stats(nc, "prefill", wait_s=0.5)))
        self.series = federate({"kvstore": kv, "decode": decode, "prefill": prefill},
                               self.model_name)
        self.refreshed += 1

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep the last answer, ask again
                log.debug("mesh stats refresh failed: %r", e)
            await asyncio.sleep(max(0.1, self.every_s))
