"""/metrics latency under load, this tree against an earlier one, in one run: each tree's
`pdmesh up` (tiny model, one prefill, one decode, kvstore on) serves 16 streams of
completions while this script scrapes /metrics every 100 ms; the scrapes' latency p50 /
p99 per tree. Before issue 34 a scrape asked kvstore and the prefill ranks for their
STATS on NATS (and waited up to half a second for them); now it reads what a background
refresh holds.

    .venv/bin/python scripts/bench_metrics_scrape.py [--before a87eaef] [--seconds 20]

Writes docs/bench/metrics_scrape.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
MODEL = ROOT / "models" / "tiny-target"


async def stream(http, url: str, stop: float) -> int:
    body = {"model": "tiny-target", "prompt": "def add(a, b):", "max_tokens": 32,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    n = 0
    while time.monotonic() < stop:
        async with http.post(url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                pass
        n += 1
    return n


async def scrape(http, url: str, stop: float) -> list[float]:
    out = []
    while time.monotonic() < stop:
        t = time.perf_counter()
        async with http.get(url + "/metrics") as r:
            await r.read()
            assert r.status == 200, r.status
        out.append((time.perf_counter() - t) * 1000)
        await asyncio.sleep(0.1)
    return out


def start(tree: Path) -> tuple[subprocess.Popen, str]:
    run_dir = Path(tempfile.mkdtemp(prefix="pdmesh-scrape-"))
    env = dict(os.environ) | {"PYTHONPATH": str(tree), "PDMESH_RUN_DIR": str(run_dir),
                              "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(PY), "-m", "pdmesh", "up", "--model", str(MODEL), "--port",
                             "0", "--no-speculation"], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("pdmesh is up:"):     # from here its output is read and dropped
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split()[3]
    raise RuntimeError(f"pdmesh up in {tree} exited {proc.wait()}")


async def measure(url: str, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:
        *done, lat = await asyncio.gather(*(stream(http, url, stop) for _ in range(16)),
                                          scrape(http, url, stop))
    q = statistics.quantiles(lat, n=100)
    return {"scrapes": len(lat), "p50_ms": round(statistics.median(lat), 2),
            "p99_ms": round(q[98], 2), "max_ms": round(max(lat), 2), "requests": sum(done)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="a87eaef")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    res = {"before": a.before, "streams": 16, "seconds": a.seconds}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", d,
                        a.before], check=True)
        try:
            for name, tree in (("before", Path(d)), ("after", ROOT)):
                proc, url = start(tree)
                try:
                    res[name] = asyncio.run(measure(url, a.seconds))
                finally:
                    proc.terminate()
                    proc.wait(60)
                print(name, res[name], flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", d])
    out = Path(a.out)
    (out / "metrics_scrape.json").write_text(json.dumps(res, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = ["p50", "p99"]
    for i, name in enumerate(("before", "after")):
        ax.bar([j + 0.38 * i for j in range(2)], [res[name]["p50_ms"], res[name]["p99_ms"]],
               0.38, label=f"{name} ({res[name]['scrapes']} scrapes)")
    ax.axhline(50, color="grey", ls="--", lw=1, label="50 ms")
    ax.set_xticks([0.19, 1.19], xs)
    ax.set_ylabel("/metrics latency, ms")
    ax.set_title("/metrics under 16 streams (tiny model, pdmesh up)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "metrics_scrape.png", dpi=120)
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
