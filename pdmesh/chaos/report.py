"""The numbers of a chaos run (pdmesh/chaos/run.py): the client's tally, decode's and
prefill's $SRV.STATS after the run, the timeline, what the guards did, and what the run
proves about the corruption rate.

    result(...)    the dict run() returns (and scripts/chaos.py writes as JSON)
    partial(...)   the same numbers so far, while the run goes on
    headline(res)  one line
    rate_bound(n)  the 95% upper bound on a rate seen 0 times in n trials
    compare(runs)  the four guard configurations side by side
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import micro

# decode counters that say which hazard a run hit and which guard caught it
HAZARD_KEYS = ("kv_writes_applied", "kv_writes_fenced", "kv_writes_not_owner",
               "kv_writes_quarantined", "kv_writes_stray", "claims_granted", "claims_refused")


# what each timeline point keeps of decode's STATS
TIMELINE_KEYS = ("aborts", "reclaims", "reclaims_by_outcome", *HAZARD_KEYS, "blocks_used",
                 "blocks_quarantined", "requests_quarantined", "requests_live", "awaiting_kv")
TALLY_KEYS = ("sent", "completed", "cancelled", "storm_requests", "errors", "mismatches")


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0               # cancelled by this client before completing
    storm_requests: int = 0
    errors: int = 0
    mismatches: int = 0
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict] = field(default_factory=list)


def point(t_s: float, tally: Tally, decode: dict) -> dict:
    """One timeline point: seconds into the load, the client's tally, decode's counters."""
    return {"t_s": round(t_s, 2), **{k: getattr(tally, k) for k in TALLY_KEYS},
            "decode": {k: decode[k] for k in TIMELINE_KEYS if k in decode}}


def rate_bound(n: int, confidence: float = 0.95) -> float | None:
    """Upper bound on a rate never seen in n independent trials: 1 - (1-c)^(1/n), about
    3/n at 95% (the rule of three)."""
    return 1.0 - (1.0 - confidence) ** (1.0 / n) if n > 0 else None


def merge_counts(stats: list[dict], key: str) -> dict:
    out: dict[str, int] = {}
    for s in stats:
        for k, v in (s.get(key) or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def guards_of(cfg: dict) -> str:
    ack, fence = cfg["reclaim_ack"], cfg["epoch_fence"]
    return {(True, True): "both", (False, True): "fence_only", (True, False): "ack_only",
            (False, False): "none"}[(ack, fence)]


def _checked(completed: int, mismatches: int) -> dict:
    """What the compared outputs say about the corruption rate per completed request."""
    out = {"checked": completed, "mismatch_rate": mismatches / completed if completed else None}
    if mismatches == 0:
        b = rate_bound(completed)
        out["rate_bound_95"] = b
        out["per_10k_bound_95"] = None if b is None else round(b * 1e4, 3)
    return out


def result(cfg: dict, tally: Tally, st: dict, problems: list[str], timeline: list[dict],
           events: list[dict], load_s: float, wall_s: float) -> dict:
    d, p = st["decode"], st["prefill"]
    dt, pt = micro.sum_stats(d), micro.sum_stats(p)
    prefill_left = pt.get("running", 0) + pt.get("waiting", 0)
    requests = tally.sent + tally.storm_requests
    return {
        "config": cfg, "guards": guards_of(cfg),
        "requests": requests, "completed": tally.completed,
        "client_cancelled": tally.cancelled, "errors": tally.errors,
        "mismatches": tally.mismatches, **_checked(tally.completed, tally.mismatches),
        "aborts": dt.get("aborts", 0), "aborts_by_reason": merge_counts(d, "aborts_by_reason"),
        "reclaims": dt.get("reclaims", 0),
        "reclaims_by_outcome": merge_counts(d, "reclaims_by_outcome"),
        **{k: dt.get(k, 0) for k in HAZARD_KEYS},
        "pd": dt.get("pd", 0), "colocated": dt.get("colocated", 0),
        "prefill_fallbacks": dt.get("prefill_fallbacks", 0),
        "prefill_kv_writes": pt.get("kv_writes", 0),
        "prefill_jobs_reclaimed": pt.get("jobs_reclaimed", 0),
        "prefill_jobs_refused": pt.get("jobs_refused", 0),
        "prefill_jobs_redelivered": pt.get("jobs_redelivered", 0),
        "blocks_leaked": dt.get("blocks_used", 0) + dt.get("blocks_quarantined", 0),
        "blocks_quarantined_after": dt.get("blocks_quarantined", 0),
        # requests decode still holds, and sequences a prefill engine still schedules
        "requests_left": dt.get("requests", 0) + dt.get("requests_live", 0) + prefill_left,
        "prefill_sequences_left": prefill_left,
        "reclaim_latency_ms": d[0].get("reclaim_latency_ms", {}) if d else {},
        "reclaim_latency_buckets": d[0].get("reclaim_latency_buckets", {}) if d else {},
        "unhealthy": problems,
        "error_samples": tally.error_samples, "mismatch_samples": tally.mismatch_samples,
        "load_s": round(load_s, 1), "wall_s": round(wall_s, 1),
        "requests_per_s": round(requests / load_s, 2) if load_s > 0 else None,
        "events": events, "timeline": timeline,
    }


def partial(cfg: dict, tally: Tally, timeline: list[dict], elapsed_s: float) -> dict:
    """The numbers so far of a run still going (no quiesce, no health check yet)."""
    last = timeline[-1]["decode"] if timeline else {}
    requests = tally.sent + tally.storm_requests
    return {"partial": True, "config": cfg, "guards": guards_of(cfg),
            "requests": requests, "completed": tally.completed,
            "client_cancelled": tally.cancelled, "errors": tally.errors,
            "mismatches": tally.mismatches, **_checked(tally.completed, tally.mismatches),
            **{k: last.get(k, 0) for k in ("aborts", "reclaims", *HAZARD_KEYS)},
            "reclaims_by_outcome": last.get("reclaims_by_outcome", {}),
            "error_samples": tally.error_samples, "mismatch_samples": tally.mismatch_samples,
            "load_s": round(elapsed_s, 1),
            "requests_per_s": round(requests / elapsed_s, 2) if elapsed_s > 0 else None,
            "timeline": timeline}


def headline(res: dict) -> str:
    lat = res.get("reclaim_latency_ms", {})
    return (f"guards={res['guards']} requests={res['requests']} "
            f"completed={res['completed']} cancelled={res['client_cancelled']} "
            f"errors={res['errors']} aborts={res['aborts']} reclaims={res['reclaims']} "
            f"{res['reclaims_by_outcome']} fenced={res['kv_writes_fenced']} "
            f"quarantined_writes={res['kv_writes_quarantined']} "
            f"mismatches={res['mismatches']} leaked={res.get('blocks_leaked')} "
            f"reclaim_ms p50={lat.get('p50')} p99={lat.get('p99')} max={lat.get('max')} "
            f"load={res['load_s']}s ({res['requests_per_s']}/s) wall={res.get('wall_s')}s "
            f"unhealthy={res.get('unhealthy')}")


def sound(res: dict) -> bool:
    """No mismatch, no error, nothing leaked or left, every service healthy."""
    return not (res["mismatches"] or res["errors"] or res["blocks_leaked"]
                or res["requests_left"] or res["unhealthy"])


def compare(runs: dict[str, dict]) -> dict:
    """The four guard configurations side by side: each guarded one must be sound, the
    unguarded one must show mismatches (else the run could not have seen corruption)."""
    keys = ("requests", "completed", "mismatches", "errors", "blocks_leaked", "aborts",
            "kv_writes_fenced", "kv_writes_quarantined", "kv_writes_stray",
            "requests_per_s", "load_s")
    table = {g: {k: r.get(k) for k in keys} | {"reclaims_by_outcome": r["reclaims_by_outcome"]}
             for g, r in runs.items()}
    problems = [f"{g}: {r['mismatches']} mismatches, {r['errors']} errors, "
                f"{r['blocks_leaked']} blocks leaked, unhealthy {r['unhealthy']}"
                for g, r in runs.items() if g != "none" and not sound(r)]
    if "none" in runs and runs["none"]["mismatches"] == 0:
        problems.append("none: 0 mismatches; the run is not hazardous enough to show "
                        "what the guards prevent")
    return {"table": table, "problems": problems}


__all__ = ["Tally", "compare", "point", "headline", "partial", "rate_bound", "result",
           "sound"]
