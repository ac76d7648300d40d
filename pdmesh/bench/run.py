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
Here: the arguments and the HTTP levels; bench_counters.py: the KV counters and the raw
NATS comparison; bench_report.py: ratios, targets, problems and the files.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdmesh.bench.counters import compare_raw, counter_delta, kv_results, mesh_counters
from pdmesh.bench.loadgen import completion_body, fmt_level, run_level, stream_one
from pdmesh.bench.rawnats import BenchError, log, responder_main
from pdmesh.bench.report import write_report
from shared import micro

DEFAULT_URL = os.environ.get("PDMESH_URL", "http://127.0.0.1:8000")
DEFAULT_NATS_URL = os.environ.get("PDMESH_NATS_URL", "nats://127.0.0.1:4222")
PATHS = ("pd", "colocated")

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


def _paths(s: str) -> list[str]:
    paths = [p.strip() for p in s.split(",") if p.strip()]
    if not set(paths) <= set(PATHS):
        raise SystemExit(f"--paths: pd and/or colocated, got {s!r}")
    return paths


def requests_for(c: int, requested: int | None) -> int:
    return max(requested, c) if requested else max(4, 2 * c)


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


@dataclass
class _Levels:
    """What every measured level needs: the HTTP session, the mesh's NATS connection (for
    the counters), the model; the counter deltas of the PD levels, per phase."""
    http: Any
    url: str
    nc: Any
    model: str
    max_tokens: int
    deltas: dict[str, list[dict]] = field(default_factory=lambda: {"short": [], "long": []})

    async def warm_up(self, prompt: str, paths: list[str]) -> None:
        for p in paths:
            await stream_one(self.http, self.url, completion_body(self.model, prompt, p, 4))

    async def level(self, prompts: list[str], path: str, c: int, label: str,
                    phase: str) -> dict:
        """One level at concurrency c; on the PD path with the counters' delta over it."""
        before = await mesh_counters(self.nc) if path == "pd" else None
        bodies = [completion_body(self.model, q, path, self.max_tokens) for q in prompts]
        r = await run_level(self.http, self.url, bodies, c, label)
        if before is not None:
            r["mesh_counters"] = counter_delta(before, await mesh_counters(self.nc))
            self.deltas[phase].append(r["mesh_counters"])
        return r


async def check_mesh(lv: _Levels, max_len: int | None, paths: list[str]) -> None:
    c0 = await mesh_counters(lv.nc)
    log(f"model {lv.model} (max_model_len {max_len}) at {lv.url}; {c0['prefill_instances']} "
        f"prefill, {c0['decode_instances']} decode; kv_window {c0['kv_window']}")
    if "pd" in paths and not c0["prefill_instances"]:
        log("WARNING: no prefill instance answered $SRV.STATS: PD requests will fall back")
    if max_len and lv.max_tokens >= max_len - 16:
        raise BenchError(f"--max-tokens {lv.max_tokens} does not fit max_model_len {max_len}")


async def short_levels(lv: _Levels, levels: list[int], paths: list[str],
                       requested: int | None) -> dict[str, dict]:
    log("warm-up: one short request per path")
    await lv.warm_up(PROMPTS[0], paths)
    runs: dict[str, dict] = {p: {} for p in paths}
    for c in levels:
        n = requests_for(c, requested)
        prompts = [f"# request {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(n)]
        for p in paths:      # interleaved, so a drift in machine load hits both paths
            label = f"{p} c={c}"
            log(f"{label}: {n} requests, max_tokens {lv.max_tokens}")
            runs[p][str(c)] = r = await lv.level(prompts, p, c, label, "short")
            log(f"{label}: {fmt_level(r)}")
    return runs


async def long_levels(lv: _Levels, paths: list[str], args, max_len: int | None) -> dict:
    if args.long_tokens <= 0:
        return {}
    target = args.long_tokens
    if max_len:
        target = min(target, max_len - lv.max_tokens - 32)
    prompts = await long_prompts(lv.http, lv.url, lv.model, target, args.long_requests)
    log(f"long prompts (~{target} tokens), c=1; warm-up one per path")
    await lv.warm_up(prompts[0], paths)
    runs: dict[str, dict] = {}
    for p in paths:
        label = f"{p} long c=1"
        runs[p] = r = await lv.level(prompts, p, 1, label, "long")
        log(f"{label}: {fmt_level(r)} (prompt {r['prompt_tokens_mean']} tokens)")
    return runs


async def bench(args, url: str, nats_url: str) -> dict:
    import aiohttp

    levels, paths = _levels(args.concurrency), _paths(args.paths)
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
        lv = _Levels(http, url, nc, model, args.max_tokens)
        await check_mesh(lv, max_len, paths)
        runs = await short_levels(lv, levels, paths, args.requests)
        long_runs = await long_levels(lv, paths, args, max_len)
        last = await mesh_counters(nc)
    finally:
        await http.close()
        await nc.close()

    kv = kv_results(lv.deltas, levels, last, args.kv_window)
    await compare_raw(kv, nats_url, args.raw_mb, args.raw_max_s)
    return {"model": model, "max_model_len": max_len, "runs": runs, "long": long_runs,
            "kv": kv, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "duration_s": time.time() - started,
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load0,
                        "loadavg_end": os.getloadavg()},
            "mesh": {k: last[k] for k in ("prefill_instances", "decode_instances")}}


# ---- entry -----------------------------------------------------------------------------------
def _spawn(args):
    from pdmesh.local.cluster import Cluster
    from pdmesh.local.overrides import parse_sets

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
    log(f"mesh up in {time.perf_counter() - t:.1f}s: {cluster.url} (nats {cluster.nats.url})")
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
    from pdmesh.local.cluster import ClusterError

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

    res["config"] = run_config(args, url, nats_url, res["kv"]["window"])
    write_report(res, Path(args.out))
    return 0


def run_config(args, url: str, nats_url: str, kv_window: int) -> dict:
    levels = _levels(args.concurrency)
    return {
        "url": url, "nats_url": nats_url, "spawn": args.spawn,
        "spawned": ({"model": args.model, "prefill": args.prefill, "decode": args.decode,
                     "dtype": args.dtype, "threads": args.threads, "kv_window": args.kv_window,
                     "set": args.set} if args.spawn else None),
        "concurrency": levels, "paths": args.paths.split(","),
        "requests_per_level": {str(c): requests_for(c, args.requests) for c in levels},
        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
        "long_tokens": args.long_tokens, "long_requests": args.long_requests,
        "raw_mb": args.raw_mb, "raw_max_s": args.raw_max_s, "kv_window": kv_window,
    }


if __name__ == "__main__":
    sys.exit(main())
