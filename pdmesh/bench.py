"""pdmesh bench: PD vs colocated latency and throughput over HTTP; KV transfer vs raw NATS.

    pdmesh bench [--url http://127.0.0.1:8000] [--nats-url nats://127.0.0.1:4222]
    pdmesh bench --spawn --model PATH [--prefill 1 --decode 1 --threads 1 --dtype float32]

Measured in one run, against one mesh:
  1. for concurrency c in (1, 4, 16) and path in (pd, colocated): streamed /v1/completions
     (fixed prompts, max_tokens fixed, ignore_eos, temperature 0, `pdmesh_path` forces the
     placement and the `x-pdmesh-path` response header is checked): TTFT (p50/p90/mean),
     inter-token latency (each gap between streamed chunks / tokens in the chunk: mean,
     p50, p90) and output tokens/s (completion tokens / wall time of the level);
  2. the same at c=1 with long prompts (~512 tokens), where the KV transfer grows;
  3. KV transfer: prefill's $SRV.STATS counters (kv_bytes / kv_transfer_s, kv_writes,
     kv_max_write_bytes) over the PD levels, against a raw nats-py baseline in the same
     run: the same payload sizes as NATS requests to a plain responder (a separate
     process that replies at once) with prefill's credit window and with a window of 1.
Writes <out>/mesh_<model>.json (every number, the config, the ratios and the targets) and
<out>/mesh_<model>.png.

Targets (reported, not enforced): PD latency at c=1 within 1.3x of colocated (TTFT p50
and ITL mean); KV transfer >= 50% of raw NATS for the same payloads and window.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from .bench_plot import plot
from .loadgen import completion_body, fmt_level, run_level, stream_one
from .rawnats import BenchError, log, raw_baseline, raw_for, responder_main

DEFAULT_URL = os.environ.get("PDMESH_URL", "http://127.0.0.1:8000")
DEFAULT_NATS_URL = os.environ.get("PDMESH_NATS_URL", "nats://127.0.0.1:4222")
PATHS = ("pd", "colocated")
TARGET_LATENCY_RATIO = 1.3
TARGET_KV_VS_RAW = 0.5

# short prompts: fixed, distinct per request (a numbered header) so no two are the same
PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
    "# Sort a list of numbers\n", "def is_prime(n):\n    if n < 2:", "try:\n    import json",
    "def __repr__(self):", "while True:\n    line = input()", "x = [i * i for i in",
    "def parse_args(argv):", "if __name__ == '__main__':", "from collections import",
    "def add(a, b):\n    return", "async def fetch(url):",
]
# one paragraph, repeated to build the long prompts
LONG_UNIT = (
    "def merge_sorted(a, b):\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n")


# ---- arguments -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pdmesh bench", description=__doc__.split("\n")[0],
        epilog="Against a running mesh by default; --spawn starts one for the run.")
    ap.add_argument("--url", default=DEFAULT_URL, help="gateway URL (%(default)s)")
    ap.add_argument("--nats-url", default=DEFAULT_NATS_URL, help="NATS URL (%(default)s)")
    sp = ap.add_argument_group("--spawn: start a local mesh (pdmesh up) for the run")
    sp.add_argument("--spawn", action="store_true")
    sp.add_argument("--model", help="HF model folder (with --spawn)")
    sp.add_argument("--prefill", type=int, default=1, metavar="N")
    sp.add_argument("--decode", type=int, default=1, metavar="M")
    sp.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    sp.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    sp.add_argument("--kv-window", type=int, default=None,
                    help="prefill's KV credit window (with --spawn; else only the raw "
                         "baseline's when prefill does not report it; default 8)")
    sp.add_argument("--kvstore", action="store_true", help="also start kvstore (idle here)")
    sp.add_argument("--set", action="append", default=[], metavar="SERVICE.FIELD=V",
                    help="a config field of one service, e.g. decode.max_num_seqs=32")
    sp.add_argument("--log-dir", default=None, help="write each service's log here")
    sp.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    ld = ap.add_argument_group("load")
    ld.add_argument("--concurrency", default="1,4,16", help="levels (%(default)s)")
    ld.add_argument("--paths", default=",".join(PATHS), help="placements (%(default)s)")
    ld.add_argument("--requests", type=int, default=None, metavar="N",
                    help="requests per level (default: max(4, 2*c)); at least c")
    ld.add_argument("--max-tokens", type=int, default=64)
    ld.add_argument("--long-tokens", type=int, default=512,
                    help="long-prompt variant: prompt tokens (0: skip)")
    ld.add_argument("--long-requests", type=int, default=4, help="long prompts per path (c=1)")
    ld.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    kv = ap.add_argument_group("raw NATS baseline")
    kv.add_argument("--raw-mb", type=float, default=64.0,
                    help="MB sent per payload size and window (%(default)s)")
    kv.add_argument("--raw-max-s", type=float, default=20.0, help="time cap per raw run")
    ap.add_argument("--out", default="bench_out", help="output folder (%(default)s)")
    ap.add_argument("--raw-responder", default=None, help=argparse.SUPPRESS)
    return ap


def _levels(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected e.g. 1,4,16, got {s!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"--concurrency: expected positive levels, got {s!r}")
    return out


def requests_for(c: int, requested: int | None) -> int:
    return max(requested, c) if requested else max(4, 2 * c)


# ---- mesh counters ($SRV.STATS) ----------------------------------------------------------------
KV_KEYS = ("kv_bytes", "kv_writes", "kv_transfer_s", "jobs_done", "jobs_failed")
DECODE_KEYS = ("pd", "colocated", "prefill_fallbacks", "kv_writes_fenced")


async def mesh_counters(nc) -> dict:
    from shared import micro

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


# ---- the run ---------------------------------------------------------------------------------
async def served_model(http, url: str) -> tuple[str, int | None]:
    async with http.get(url + "/v1/models") as r:
        if r.status != 200:
            raise BenchError(f"GET {url}/v1/models: HTTP {r.status}")
        card = (await r.json())["data"][0]
    return card["id"], card.get("max_model_len")


async def prompt_tokens(http, url: str, model: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "pdmesh_path": "colocated"}
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise BenchError(f"probe: HTTP {r.status}: {(await r.text())[:300]}")
        return (await r.json())["usage"]["prompt_tokens"]


async def long_prompts(http, url, model, target: int, n: int) -> list[str]:
    """n distinct prompts of about `target` tokens (as the gateway's tokenizer counts):
    LONG_UNIT's lines, cycled; the line count is found with a few probes."""
    lines = LONG_UNIT.splitlines(keepends=True)

    def build(k: int, i: int = 0) -> str:
        return f"# file {i}: utilities\n" + "".join(lines[j % len(lines)] for j in range(k))

    k = 4 * len(lines)
    per_line = await prompt_tokens(http, url, model, build(k)) / k
    k = max(1, round(target / per_line))
    for _ in range(4):
        got = await prompt_tokens(http, url, model, build(k))
        if got <= target and target - got <= max(8, target // 50):
            break
        step = math.floor((target - got) / per_line)
        k = max(1, k + (step if step else (-1 if got > target else 1)))
    return [build(k, i) for i in range(n)]


async def bench(args, url: str, nats_url: str) -> dict:
    import aiohttp

    from shared import micro

    levels = _levels(args.concurrency)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not set(paths) <= set(PATHS):
        raise SystemExit(f"--paths: pd and/or colocated, got {args.paths!r}")
    try:
        nc = await micro.connect_once(nats_url)
    except ConnectionError as e:
        raise BenchError(str(e)) from None
    started = time.time()
    load0 = os.getloadavg()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout),
                                 connector=aiohttp.TCPConnector(limit=0))
    try:
        model, max_len = await served_model(http, url)
        c0 = await mesh_counters(nc)
        log(f"model {model} (max_model_len {max_len}) at {url}; {c0['prefill_instances']} "
            f"prefill, {c0['decode_instances']} decode; kv_window {c0['kv_window']}")
        if "pd" in paths and not c0["prefill_instances"]:
            log("WARNING: no prefill instance answered $SRV.STATS: PD requests will fall back")
        mt = args.max_tokens
        if max_len and mt >= max_len - 16:
            raise BenchError(f"--max-tokens {mt} does not fit max_model_len {max_len}")

        log("warm-up: one short request per path")
        for p in paths:
            await stream_one(http, url, completion_body(model, PROMPTS[0], p, 4))

        runs: dict[str, dict] = {p: {} for p in paths}
        kv_deltas: dict[str, list[dict]] = {"short": [], "long": []}
        for c in levels:
            n = requests_for(c, args.requests)
            prompts = [f"# request {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(n)]
            for p in paths:      # interleaved, so a drift in machine load hits both paths
                label = f"{p} c={c}"
                log(f"{label}: {n} requests, max_tokens {mt}")
                before = await mesh_counters(nc) if p == "pd" else None
                r = await run_level(http, url, [completion_body(model, q, p, mt)
                                                for q in prompts], c, label)
                if before is not None:
                    r["mesh_counters"] = counter_delta(before, await mesh_counters(nc))
                    kv_deltas["short"].append(r["mesh_counters"])
                runs[p][str(c)] = r
                log(f"{label}: {fmt_level(r)}")

        long_runs: dict[str, dict] = {}
        if args.long_tokens > 0:
            target = args.long_tokens
            if max_len:
                target = min(target, max_len - mt - 32)
            prompts = await long_prompts(http, url, model, target, args.long_requests)
            log(f"long prompts (~{target} tokens), c=1; warm-up one per path")
            for p in paths:
                await stream_one(http, url, completion_body(model, prompts[0], p, 4))
            for p in paths:
                label = f"{p} long c=1"
                before = await mesh_counters(nc) if p == "pd" else None
                r = await run_level(http, url, [completion_body(model, q, p, mt)
                                                for q in prompts], 1, label)
                if before is not None:
                    r["mesh_counters"] = counter_delta(before, await mesh_counters(nc))
                    kv_deltas["long"].append(r["mesh_counters"])
                long_runs[p] = r
                log(f"{label}: {fmt_level(r)} (prompt {r['prompt_tokens_mean']} tokens)")

        c1 = await mesh_counters(nc)
    finally:
        await http.close()
        await nc.close()

    has_t = c1["has_transfer_s"]
    if "pd" in paths and not has_t:
        log("WARNING: prefill has no kv_transfer_s counter: KV throughput not measured")
    kv = {"window": c1["kv_window"] or args.kv_window or 8, "has_transfer_s": has_t,
          "short": kv_summary(kv_deltas["short"], has_t),
          "long": kv_summary(kv_deltas["long"], has_t),
          "all": kv_summary(kv_deltas["short"] + kv_deltas["long"], has_t),
          "per_level": {c: d for c, d in zip([str(x) for x in levels], kv_deltas["short"])}}
    for d in kv["per_level"].values():
        d["bytes_per_s"] = (d["kv_bytes"] / d["kv_transfer_s"]
                            if has_t and d["kv_transfer_s"] > 0 else None)

    # raw NATS: each phase's mean write size, the prefill's window and a window of 1
    sizes = sorted({round(kv[ph]["mean_write_bytes"]) for ph in ("short", "long") if kv[ph]})
    raw: list[dict] = []
    if sizes:
        windows = sorted({kv["window"], 1}, reverse=True)
        log(f"raw NATS baseline: payloads {[f'{s / 1024:.1f} KiB' for s in sizes]}, "
            f"windows {windows}, {args.raw_mb:g} MB each")
        raw = await raw_baseline(nats_url, sizes, windows, args.raw_mb * 1e6, args.raw_max_s)
    kv["raw_nats"] = raw
    for w, key in ((kv["window"], "raw_bytes_per_s"), (1, "raw_window1_bytes_per_s")):
        for ph in ("short", "long"):
            s = kv[ph]
            if s:
                r = raw_for(raw, max(1, round(s["mean_write_bytes"])), w)
                s[key] = r and r["bytes_per_s"]
        # all PD levels: the time the same payloads would take raw, phase by phase
        phases = [kv[ph] for ph in ("short", "long") if kv[ph]]
        if kv["all"] and phases and all(s.get(key) for s in phases):
            kv["all"][key] = (sum(s["kv_bytes"] for s in phases)
                              / sum(s["kv_bytes"] / s[key] for s in phases))

    return {"model": model, "max_model_len": max_len, "runs": runs, "long": long_runs,
            "kv": kv, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "duration_s": time.time() - started,
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load0,
                        "loadavg_end": os.getloadavg()},
            "mesh": {k: c1[k] for k in ("prefill_instances", "decode_instances")}}


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


# ---- entry -----------------------------------------------------------------------------------
def _spawn(args):
    from pdmesh.cluster import Cluster
    from pdmesh.overrides import parse_sets

    if not args.model:
        raise SystemExit("pdmesh bench --spawn needs --model PATH")
    overrides = parse_sets(args.set)
    if args.kv_window:
        overrides.setdefault("prefill", {})["kv_window"] = args.kv_window
    cluster = Cluster(model=args.model, prefill=args.prefill, decode=args.decode,
                      dtype=args.dtype, threads=args.threads, kvstore=args.kvstore,
                      overrides=overrides, echo=False, log_dir=args.log_dir,
                      startup_timeout_s=args.startup_timeout)
    log(f"starting a mesh: {args.prefill} prefill, {args.decode} decode, model {args.model}")
    t = time.perf_counter()
    cluster.start()
    log(f"mesh up in {time.perf_counter() - t:.1f}s: {cluster.url} (nats {cluster.nats_url})")
    return cluster


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.raw_responder:
        return _run(responder_main(args.raw_responder, args.nats_url))
    cluster = None
    url, nats_url = args.url.rstrip("/"), args.nats_url
    from pdmesh.cluster import ClusterError

    try:
        if args.spawn:
            cluster = _spawn(args)
            url, nats_url = cluster.url, cluster.nats_url
        res = _run(bench(args, url, nats_url))
    except (BenchError, ClusterError) as e:
        print(f"pdmesh bench: {e}", file=sys.stderr)
        if cluster is not None:
            for p in cluster.unexpected_exits():
                print(f"--- {p.name} exited {p.returncode}:\n{p.tail()}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.stop()

    res["config"] = {
        "url": url, "nats_url": nats_url, "spawn": args.spawn,
        "spawned": ({"model": args.model, "prefill": args.prefill, "decode": args.decode,
                     "dtype": args.dtype, "threads": args.threads, "kv_window": args.kv_window,
                     "set": args.set} if args.spawn else None),
        "concurrency": _levels(args.concurrency), "paths": args.paths.split(","),
        "requests_per_level": {str(c): requests_for(c, args.requests)
                               for c in _levels(args.concurrency)},
        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
        "long_tokens": args.long_tokens, "long_requests": args.long_requests,
        "raw_mb": args.raw_mb, "raw_max_s": args.raw_max_s, "kv_window": res["kv"]["window"],
    }
    res["ratios"], res["targets"] = ratios_and_targets(res)
    res["problems"] = problems(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "mesh_" + re.sub(r"[^A-Za-z0-9._-]", "_", res["model"])
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot(res, out / f"{stem}.png")
    log("ratios: " + json.dumps({k: None if v is None else round(v, 3)
                                 for k, v in res["ratios"].items()}))
    for name, t in res["targets"].items():
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        log(f"target {name}: {v} ({t['target']}): {verdict}")
    for p in res["problems"]:
        log(f"WARNING: {p}")
    log(f"wrote {out / stem}.json and .png")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
