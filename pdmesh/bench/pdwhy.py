"""Why PD exists: decode's inter-token latency while long prompts keep arriving.

One mesh (1 prefill, 1 decode, one torch thread each). 8 streamed requests decode for the
whole phase while a ~2,000-token prompt arrives every second (1 output token each). In the
`colocated` phase those prompts are computed by decode's own engine, chunk by chunk
between its decode steps; in the `pd` phase by prefill, decode only receiving their KV.
Every token of the 8 streams is timestamped: ITL p50/p90/p99 per phase, and the ITL time
series (with the arrivals) plotted. Writes <out>/pdwhy_<model>.json and .png.

    python -m pdmesh.bench.pdwhy [--model models/tiny-target] [--seconds 20]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pdmesh.bench.loadgen import completion_body, percentile
from pdmesh.bench.rawnats import log
from pdmesh.bench.report import save
from pdmesh.bench.ttft import long_prompt


async def decode_stream(http, url, body, t0: float, gaps: list) -> None:
    """Stream one request; (time since t0, seconds per token) for every gap."""
    last = None
    async with http.post(url + "/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            ch = (json.loads(line[5:]).get("choices") or [{}])[0]
            n = len(ch.get("token_ids") or ())
            if not n:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - t0, (now - last) / n))
            last = now


async def phase(url: str, model: str, path: str, args) -> dict:
    import aiohttp

    gaps: list[tuple[float, float]] = []
    arrivals: list[float] = []
    ttfts: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=conn) as http:
        t0 = time.perf_counter()
        bg = [asyncio.ensure_future(decode_stream(
            http, url, completion_body(model, f"# stream {path} {i}\ndef f{i}(x):", "colocated",
                                       args.decode_tokens), t0, gaps)) for i in range(8)]
        await asyncio.sleep(args.warmup)

        async def one_long(i: int) -> None:
            t = time.perf_counter()
            body = completion_body(model, f"{path} {i}: " + long_prompt(i, args.long_lines),
                                   path, 1)
            async with http.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"long prompt: HTTP {r.status}")
            ttfts.append(time.perf_counter() - t)

        longs = []
        for i in range(args.seconds):
            arrivals.append(time.perf_counter() - t0)
            longs.append(asyncio.ensure_future(one_long(i)))
            await asyncio.sleep(1.0)
        end = time.perf_counter() - t0
        for t in bg:
            t.cancel()
        errors = [e for e in await asyncio.gather(*longs, return_exceptions=True) if e]
        if errors:
            raise RuntimeError(f"{len(errors)} long prompts failed: {errors[0]!r}")
    window = [(t, g) for t, g in gaps if args.warmup <= t <= end]
    itl = [g for _, g in window]
    return {"itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
            "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl), "tokens": len(itl),
            "long_prompts": len(arrivals), "long_latency_p50_s": percentile(ttfts, 50),
            "series": window, "arrivals": arrivals}


def pin(cluster) -> dict:
    """Decode alone on the last core; prefill and everything else (nats, gateway, this
    load generator) on the others: prefill and decode each with its own core."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    rest = set(cores[:-1])
    out = {}
    for name, p in cluster.procs.items():
        cpus = {cores[-1]} if name.startswith("decode") else rest
        os.sched_setaffinity(p.popen.pid, cpus)
        out[name] = sorted(cpus)
    os.sched_setaffinity(0, rest)
    return out


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for a, path in zip(ax, ("colocated", "pd")):
        r = res["phases"][path]
        a.plot([t for t, _ in r["series"]], [g * 1e3 for _, g in r["series"]], ".", ms=2,
               label="ITL of the 8 decoding streams")
        for t in r["arrivals"]:
            a.axvline(t, c="tab:red", alpha=.25, lw=1)
        a.axhline(r["itl_p99_s"] * 1e3, c="k", ls="--", lw=1,
                  label=f"p99 {r['itl_p99_s'] * 1e3:.0f} ms")
        a.set_ylabel("ITL (ms)")
        a.set_title(f"{path}: 2,000-token prompts arrive every second (red)")
        a.legend(fontsize=8, loc="upper right")
    ax[1].set_xlabel("seconds")
    fig.suptitle(f"decode ITL p99: colocated / PD = {res['itl_p99_colocated_over_pd']:.2f}x "
                 f"({res['model']}, 1 prefill + 1 decode, 1 thread each)")
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.bench.pdwhy", description=__doc__)
    ap.add_argument("--model", default="models/tiny-target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seconds", type=int, default=20, help="long prompts: one per second")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--decode-tokens", type=int, default=1500)
    ap.add_argument("--long-lines", type=int, default=193, help="~2,000 tokens")
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    from pdmesh.local.cluster import Cluster

    over = {"decode": {"prefix_cache": False, "max_num_seqs": 16},
            "prefill": {"prefix_cache": False}}
    res = {"model": Path(args.model).name, "dtype": args.dtype, "seconds": args.seconds,
           "phases": {}}
    with Cluster(args.model, prefill=1, decode=1, threads=1, dtype=args.dtype, kvstore=False,
                 overrides=over, echo=False) as c:
        res["pinned"] = pin(c)
        time.sleep(2.0)
        for path in ("colocated", "pd"):
            log(f"{path}: 8 streams decoding, a long prompt every second for {args.seconds}s")
            r = asyncio.run(phase(c.url, Path(args.model).name, path, args))
            res["phases"][path] = r
            log(f"{path}: ITL p50 {r['itl_p50_s'] * 1e3:.1f} ms p99 {r['itl_p99_s'] * 1e3:.1f} "
                f"ms max {r['itl_max_s'] * 1e3:.0f} ms over {r['tokens']} tokens")
    res["itl_p99_colocated_over_pd"] = (res["phases"]["colocated"]["itl_p99_s"]
                                        / res["phases"]["pd"]["itl_p99_s"])
    path = save(res, args.out, f"pdwhy_{res['model']}", plot)
    log(f"ITL p99 colocated / PD: {res['itl_p99_colocated_over_pd']:.2f}x; wrote {path}.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
