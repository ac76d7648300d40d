"""pdmesh bench, the verdict: PD/colocated and KV/raw-NATS ratios, the targets, anything
that makes the numbers suspect, and the files (<out>/mesh_<model>.json and .png).

Targets (reported, not enforced): PD latency at c=1 within 1.3x of colocated (TTFT p50
and ITL mean); KV transfer >= 50% of raw NATS for the same payloads and window.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from pdmesh.bench.plot import plot
from pdmesh.bench.rawnats import log

TARGET_LATENCY_RATIO = 1.3
TARGET_KV_VS_RAW = 0.5


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios_and_targets(res: dict) -> tuple[dict, dict]:
    runs, lg, kv = res["runs"], res["long"], res["kv"]
    r: dict = {}
    if "pd" in runs and "colocated" in runs and "1" in runs["pd"] and "1" in runs["colocated"]:
        pd, co = runs["pd"]["1"], runs["colocated"]["1"]
        r["pd_vs_colocated_ttft_c1"] = _ratio(pd["ttft_s"]["p50"], co["ttft_s"]["p50"])
        r["pd_vs_colocated_ttft_c1_mean"] = _ratio(pd["ttft_s"]["mean"], co["ttft_s"]["mean"])
        r["pd_vs_colocated_itl_c1"] = _ratio(pd["itl_s"]["mean"], co["itl_s"]["mean"])
        r["pd_vs_colocated_itl_c1_p50"] = _ratio(pd["itl_s"]["p50"], co["itl_s"]["p50"])
    for c in runs.get("pd", {}):
        if c in runs.get("colocated", {}):
            r[f"pd_vs_colocated_tokens_per_s_c{c}"] = _ratio(
                runs["pd"][c]["tokens_per_s"], runs["colocated"][c]["tokens_per_s"])
    if "pd" in lg and "colocated" in lg:
        r["pd_vs_colocated_ttft_long_c1"] = _ratio(lg["pd"]["ttft_s"]["p50"],
                                                   lg["colocated"]["ttft_s"]["p50"])
        r["pd_vs_colocated_itl_long_c1"] = _ratio(lg["pd"]["itl_s"]["mean"],
                                                  lg["colocated"]["itl_s"]["mean"])
    for ph in ("all", "short", "long"):
        s = kv.get(ph)
        if s:
            sfx = "" if ph == "all" else f"_{ph}"
            r[f"kv_vs_raw_nats{sfx}"] = _ratio(s["bytes_per_s"], s.get("raw_bytes_per_s"))
            r[f"kv_vs_raw_nats_window1{sfx}"] = _ratio(s["bytes_per_s"],
                                                       s.get("raw_window1_bytes_per_s"))

    def met(x, limit, le=True):
        return None if x is None else (x <= limit if le else x >= limit)

    t = {
        "pd_c1_ttft_within_1.3x_colocated": {
            "value": r.get("pd_vs_colocated_ttft_c1"), "target": f"<= {TARGET_LATENCY_RATIO}",
            "met": met(r.get("pd_vs_colocated_ttft_c1"), TARGET_LATENCY_RATIO)},
        "pd_c1_itl_within_1.3x_colocated": {
            "value": r.get("pd_vs_colocated_itl_c1"), "target": f"<= {TARGET_LATENCY_RATIO}",
            "met": met(r.get("pd_vs_colocated_itl_c1"), TARGET_LATENCY_RATIO)},
        "kv_transfer_ge_50pct_raw_nats": {
            "value": r.get("kv_vs_raw_nats"), "target": f">= {TARGET_KV_VS_RAW}",
            "met": met(r.get("kv_vs_raw_nats"), TARGET_KV_VS_RAW, le=False)},
    }
    return r, t


def problems(res: dict) -> list[str]:
    """Anything that makes the numbers suspect: failures, answers on the wrong path,
    PD requests that decode prefilled itself."""
    out = []
    levels = [(f"{p} c={c}", r) for p, by_c in res["runs"].items() for c, r in by_c.items()]
    levels += [(f"{p} long", r) for p, r in res["long"].items()]
    for name, r in levels:
        if r["errors"]:
            out.append(f"{name}: {r['errors']} of {r['requests']} requests failed "
                       f"({'; '.join(r['error_samples'])})")
        if r["path_mismatch"]:
            out.append(f"{name}: {r['path_mismatch']} answers on another path "
                       f"(x-pdmesh-path {r['paths_seen']})")
        fb = (r.get("mesh_counters") or {}).get("decode_prefill_fallbacks")
        if fb:
            out.append(f"{name}: decode prefilled {fb} PD requests itself (prefill fallback)")
    return out


def save(res: dict, out: str | Path, stem: str, plot_fn) -> Path:
    """Any benchmark's files: res as <out>/<stem>.json, plot_fn(res, path) as <stem>.png;
    returns <out>/<stem>."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot_fn(res, out / f"{stem}.png")
    return out / stem


def write_report(res: dict, out: Path) -> None:
    """Ratios, targets and problems into res; res as JSON and the plot under out; a summary
    on stderr."""
    res["ratios"], res["targets"] = ratios_and_targets(res)
    res["problems"] = problems(res)
    path = save(res, out, "mesh_" + re.sub(r"[^A-Za-z0-9._-]", "_", res["model"]), plot)
    log("ratios: " + json.dumps({k: None if v is None else round(v, 3)
                                 for k, v in res["ratios"].items()}))
    for name, t in res["targets"].items():
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        log(f"target {name}: {v} ({t['target']}): {verdict}")
    for p in res["problems"]:
        log(f"WARNING: {p}")
    log(f"wrote {path}.json and .png")
