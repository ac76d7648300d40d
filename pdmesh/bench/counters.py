"""pdmesh bench, the KV side: prefill's and decode's $SRV.STATS counters around each PD
level, the KV throughput they give, and the same payloads over raw NATS for comparison.
"""
from __future__ import annotations

import asyncio

from pdmesh.bench.rawnats import log, raw_baseline, raw_for
from shared import micro

KV_KEYS = ("kv_bytes", "kv_writes", "kv_transfer_s", "jobs_done", "jobs_failed")
DECODE_KEYS = ("pd", "colocated", "prefill_fallbacks", "kv_writes_fenced")
PHASES = ("short", "long")


async def mesh_counters(nc) -> dict:
    pre, dec = await asyncio.gather(micro.service_stats(nc, "prefill"),
                                    micro.service_stats(nc, "decode"))
    pre_total, dec_total = micro.sum_stats(pre), micro.sum_stats(dec)
    out: dict = {"prefill_instances": len(pre), "decode_instances": len(dec),
                 "has_transfer_s": bool(pre) and all("kv_transfer_s" in s for s in pre)}
    out |= {k: pre_total.get(k, 0) for k in KV_KEYS}
    out["kv_max_write_bytes"] = max((s.get("kv_max_write_bytes") or 0 for s in pre), default=0)
    out["kv_window"] = next((s["kv_window"] for s in pre if "kv_window" in s), None)
    out |= {"decode_" + k: dec_total.get(k, 0) for k in DECODE_KEYS}
    return out


def counter_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in KV_KEYS}
    d |= {"decode_" + k: after["decode_" + k] - before["decode_" + k] for k in DECODE_KEYS}
    d["kv_max_write_bytes"] = after["kv_max_write_bytes"]
    return d


def kv_summary(deltas: list[dict], has_transfer_s: bool) -> dict | None:
    """Sum of kv_bytes / sum of kv_transfer_s over some PD levels (per-job throughput)."""
    b = sum(d["kv_bytes"] for d in deltas)
    w = sum(d["kv_writes"] for d in deltas)
    t = sum(d["kv_transfer_s"] for d in deltas)
    if not w:
        return None
    return {"kv_bytes": b, "kv_writes": w, "jobs": sum(d["jobs_done"] for d in deltas),
            "kv_transfer_s": t if has_transfer_s else None,
            "bytes_per_s": b / t if has_transfer_s and t > 0 else None,
            "mean_write_bytes": b / w,
            "max_write_bytes": max(d["kv_max_write_bytes"] for d in deltas)}


def kv_results(deltas: dict[str, list[dict]], levels: list[int], last: dict,
               kv_window: int | None) -> dict:
    """The KV numbers of the run: per phase (short/long prompts), all PD levels together,
    and per short level. last: the counters after the run; kv_window: the flag's."""
    has_t = last["has_transfer_s"]
    if not has_t and any(deltas.values()):
        log("WARNING: prefill has no kv_transfer_s counter: KV throughput not measured")
    kv = {"window": last["kv_window"] or kv_window or 8, "has_transfer_s": has_t,
          "short": kv_summary(deltas["short"], has_t),
          "long": kv_summary(deltas["long"], has_t),
          "all": kv_summary(deltas["short"] + deltas["long"], has_t),
          "per_level": {c: d for c, d in zip([str(x) for x in levels], deltas["short"])}}
    for d in kv["per_level"].values():
        d["bytes_per_s"] = (d["kv_bytes"] / d["kv_transfer_s"]
                            if has_t and d["kv_transfer_s"] > 0 else None)
    return kv


async def compare_raw(kv: dict, nats_url: str, raw_mb: float, raw_max_s: float) -> None:
    """Raw NATS at each phase's mean write size, with prefill's window and a window of 1;
    adds raw_nats and the raw_*bytes_per_s of every phase (and of all) to kv."""
    sizes = sorted({round(kv[ph]["mean_write_bytes"]) for ph in PHASES if kv[ph]})
    raw: list[dict] = []
    if sizes:
        windows = sorted({kv["window"], 1}, reverse=True)
        log(f"raw NATS baseline: payloads {[f'{s / 1024:.1f} KiB' for s in sizes]}, "
            f"windows {windows}, {raw_mb:g} MB each")
        raw = await raw_baseline(nats_url, sizes, windows, raw_mb * 1e6, raw_max_s)
    kv["raw_nats"] = raw
    for w, key in ((kv["window"], "raw_bytes_per_s"), (1, "raw_window1_bytes_per_s")):
        for ph in PHASES:
            s = kv[ph]
            if s:
                r = raw_for(raw, max(1, round(s["mean_write_bytes"])), w)
                s[key] = r and r["bytes_per_s"]
        # all PD levels: the time the same payloads would take raw, phase by phase
        phases = [kv[ph] for ph in PHASES if kv[ph]]
        if kv["all"] and phases and all(s.get(key) for s in phases):
            kv["all"][key] = (sum(s["kv_bytes"] for s in phases)
                              / sum(s["kv_bytes"] / s[key] for s in phases))
