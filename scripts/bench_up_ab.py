"""`pdmesh up` at two revisions, as users launch it (its defaults, the default model), both
up at once, the same load taking turns between them: streamed /v1/completions, greedy, 64
tokens, at c=1 and c=16. Each round runs every level on both meshes, the order flipped
every other round, so a shared host's drift lands on both alike; per mesh and level the
median over rounds of tokens/s, ITL p50 and TTFT p50, and the ratio head / base per round.

    python scripts/bench_up_ab.py --base REV [--head HEAD] [--rounds 3] [--out docs/bench]

Each revision runs from its own git worktree (committed code only) with this checkout's
venv; the C++ ops build per revision (their cache is keyed by source). Writes
<out>/up_ab.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pdmesh.bench.http import start, stop, wait_http
from pdmesh.bench.loadgen import completion_body, run_level
from pdmesh.bench.report import save

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ((1, 8), (16, 32))       # (concurrency, requests)
TOKENS = 64


def log(msg: str) -> None:
    print(f"[up_ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def level(url: str, model: str, c: int, n: int, label: str) -> dict:
    """n requests, c at a time (pdmesh.bench.loadgen's load generator, the path left to the
    gateway): tokens/s over the wall, ITL and TTFT medians (ms)."""
    bodies = []
    for i in range(n):
        body = completion_body(model, f"Write a short story about a robot, number {i}.",
                               "", TOKENS)
        del body["pdmesh_path"]                # placed as users' requests are
        bodies.append(body)
    async with aiohttp.ClientSession() as http:
        r = await run_level(http, url, bodies, c, label)
    if r["errors"]:
        raise RuntimeError(f"{url}: {r['error_samples']}")
    return {"tokens_per_s": r["tokens_per_s"], "itl_p50_ms": r["itl_s"]["p50"] * 1e3,
            "ttft_p50_ms": r["ttft_s"]["p50"] * 1e3}


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def measure(trees: dict[str, Path], rounds: int, tmp: Path) -> dict:
    procs, urls = {}, {}
    try:
        for label, tree in trees.items():
            procs[label], urls[label] = start(
                [sys.executable, "-m", "pdmesh", "up", "--port", "0"], tmp / f"up_{label}.log",
                cwd=tree)
        for label, url in urls.items():
            wait_http(url, "/ready")
            log(f"{label}: serving at {url}")
        model = model_id(urls["head"])
        for label, url in urls.items():                            # warm both
            asyncio.run(level(url, model, 4, 8, f"{label} warm-up"))
        runs: dict = {label: {str(c): [] for c, _ in LEVELS} for label in trees}
        for r in range(rounds):
            for c, n in LEVELS:
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for label in order:
                    res = asyncio.run(level(urls[label], model, c, n, f"{label} c={c}"))
                    runs[label][str(c)].append(res)
                    log(f"round {r + 1}/{rounds} {label} c={c}: {res['tokens_per_s']:.1f} tok/s, "
                        f"ITL p50 {res['itl_p50_ms']:.1f} ms, TTFT p50 {res['ttft_p50_ms']:.0f} ms")
        return {"model": model, "runs": runs}
    finally:
        for p in procs.values():
            stop(p)


def summarize(doc: dict) -> dict:
    runs = doc["runs"]
    med = {label: {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                   for c, rs in by_c.items()} for label, by_c in runs.items()}
    ratio = {c: statistics.median(h["tokens_per_s"] / b["tokens_per_s"]
                                  for h, b in zip(runs["head"][c], runs["base"][c]))
             for c in runs["head"]}
    wins = {c: sum(h["tokens_per_s"] > b["tokens_per_s"]
                   for h, b in zip(runs["head"][c], runs["base"][c])) for c in runs["head"]}
    return doc | {"medians": med, "head_over_base_tokens_per_s": ratio, "head_wins": wins}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(res["medians"]["head"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for i, label in enumerate(("base", "head")):
        xs = [j + 0.35 * i for j in range(len(levels))]
        ax[0].bar(xs, [res["medians"][label][c]["tokens_per_s"] for c in levels], 0.35,
                  label=f"{label} {res[label]}")
        ax[1].bar(xs, [res["medians"][label][c]["itl_p50_ms"] for c in levels], 0.35,
                  label=f"{label} {res[label]}")
    for a, name in zip(ax, ("output tokens/s", "ITL p50 (ms)")):
        a.set_xticks([j + 0.175 for j in range(len(levels))], [f"c={c}" for c in levels])
        a.set_ylabel(name)
        a.legend()
    r = res["head_over_base_tokens_per_s"]
    fig.suptitle(f"pdmesh up {res['head']} / {res['base']} ({res['model']}, "
                 f"{res['rounds']} alternating rounds): tokens/s "
                 + ", ".join(f"c={c} {v:.2f}x" for c, v in r.items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--head", default="HEAD", help="the revision measured (%(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-up-ab-"))
    trees = {"base": tmp / "base", "head": tmp / "head"}
    revs = {}
    for label, rev in (("base", a.base), ("head", a.head)):
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(trees[label]), rev],
                       cwd=ROOT, check=True, capture_output=True)
        revs[label] = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout.strip()
    try:
        doc = measure(trees, a.rounds, tmp)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
    res = summarize(doc | revs | {"rounds": a.rounds, "tokens": TOKENS})
    save(res, a.out, "up_ab", plot)
    for c, v in res["head_over_base_tokens_per_s"].items():
        log(f"c={c}: head / base tokens/s {v:.2f} (head won {res['head_wins'][c]} of "
            f"{a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
