"""Run benchmarks on two revisions side by side, in one run, alternating, and write the
ratios (JSON + PNG). Used to show that a change that should not change speed did not.

    python scripts/compare_revisions.py --base 7b410f4 [--head HEAD] [--rounds 2] [--out docs/bench]

Each revision runs from its own temporary git worktree (committed code only: edits in
progress in this checkout never leak into a measurement) with this checkout's venv. Benchmarks: the engine benchmark on the tiny
model (float32, one thread) and the mesh benchmark (`pdmesh bench --spawn`, one prefill,
one decode, one thread each), and `ttft` (PD vs colocated TTFT, pdmesh.bench.ttft's default
mesh, short prompts), and `kv` (pdmesh.bench.kv: KV transfer MB/s and its ratio to raw nats-py).
Rounds alternate base/head so drift hits both alike; each
metric is the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"

BENCHES = {
    "engine": ["scripts/bench_engine.py", "--model", "models/tiny-target", "--dtype", "float32",
               "--threads", "1", "--prompts", "8", "--max-tokens", "32"],
    "mesh": ["-m", "pdmesh.cli", "bench", "--spawn", "--model", "models/tiny-target",
             "--threads", "1"],
    "ttft": ["-m", "pdmesh.bench.ttft", "--configs", "default", "--short", "40", "--long", "1"],
    "kv": ["-m", "pdmesh.bench.kv", "--reps", "5"],
}
# a revision from before pdmesh/ was grouped into local/, deploy/, bench/, chaos/
FLAT = {"pdmesh.bench.ttft": "pdmesh.bench_ttft", "pdmesh.bench.kv": "pdmesh.bench_kv"}


def command(rev_dir: Path, name: str) -> list[str]:
    argv = BENCHES[name]
    if not (rev_dir / "pdmesh" / "bench").is_dir():
        argv = [FLAT.get(a, a) for a in argv]
    return argv


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def metrics(name: str, out: Path) -> dict[str, float]:
    """The numbers worth comparing from one benchmark's JSON."""
    f = next(out.glob(f"{name}_*.json"))
    d = json.loads(f.read_text())
    if name == "ttft":
        s = d["configs"]["default"]["short"]
        gaps = [a - b for a, b in zip(s["pd"]["ttft_s"], s["colocated"]["ttft_s"])]
        floor = d["configs"]["default"].get("hop_floor")    # (revisions that measure it)
        return {"ttft_short_pd_p50_ms": s["pd"]["ttft_p50_s"] * 1e3,
                "ttft_short_colocated_p50_ms": s["colocated"]["ttft_p50_s"] * 1e3,
                "ttft_short_pd_over_colocated": s["ratio_p50"],
                "ttft_short_pd_minus_colocated_ms": statistics.median(gaps) * 1e3} | (
            {"ttft_two_idle_hops_ms": floor["rtt_p50_s"] * 1e3,
             "ttft_short_ratio_floor": floor["ratio_floor"]} if floor else {})
    if name == "kv":
        return {f"kv_{k}": r["bytes_per_s"] / 1e6 for k, r in d["runs"].items()} | {
            f"kv_{k}_vs_raw": r["vs_raw"] for k, r in d["runs"].items()}
    if name == "engine":
        return {f"engine_{label}_tok_s": r["tokens_per_s"] for label, r in d["runs"].items()
                if label.startswith("engine")}
    m = {}
    for path, levels in d["runs"].items():
        for c, r in levels.items():
            m[f"mesh_{path}_c{c}_tok_s"] = r["tokens_per_s"]
            m[f"mesh_{path}_c{c}_ttft_p50_ms"] = r["ttft_s"]["p50"] * 1e3
    return m


FAILURES: list[dict] = []     # benchmark runs that failed and were rerun (in the JSON)


def run(rev_dir: Path, name: str, tmp: Path, tries: int = 3) -> dict[str, float]:
    """One benchmark run on one revision; a run that fails (a benchmark over a real
    nats-server can lose its responder) is rerun, up to `tries` in all, and recorded."""
    for attempt in range(1, tries + 1):
        out = tmp / f"{rev_dir.name}-{name}-{time.monotonic_ns()}"
        cmd = [str(PY), *command(rev_dir, name), "--out", str(out)]
        log(f"{rev_dir}: {' '.join(command(rev_dir, name))}")
        p = subprocess.run(cmd, cwd=rev_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env={"PYTHONPATH": str(rev_dir), "PATH": "/usr/bin:/bin"})
        if p.returncode == 0:
            return metrics(name, out)
        tail = p.stderr.strip().splitlines()[-1:] or [""]
        FAILURES.append({"rev": rev_dir.name, "bench": name, "attempt": attempt,
                         "rc": p.returncode, "error": tail[0]})
        log(f"{rev_dir.name} {name} failed (rc {p.returncode}): {tail[0]}")
    raise SystemExit(f"{name} on {rev_dir.name} failed {tries} times")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--head", default="HEAD", help="the revision measured (%(default)s)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--benches", default="engine,mesh")
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-compare-"))
    base, head = tmp / "base", tmp / "head"
    for path, rev in ((base, a.base), (head, a.head)):
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(path), rev], cwd=ROOT,
                       check=True, capture_output=True)
    results: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    try:
        for i in range(a.rounds):
            for name in a.benches.split(","):
                for label, d in (("base", base), ("head", head)) if i % 2 == 0 else \
                        (("head", head), ("base", base)):
                    for k, v in run(d, name, tmp).items():
                        results[label].setdefault(k, []).append(v)
    finally:
        head_rev = subprocess.run(["git", "rev-parse", "--short", a.head], cwd=ROOT,
                                  capture_output=True, text=True).stdout.strip()
        for path in (base, head):
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           capture_output=True)
    rows = {k: {"base": statistics.median(results["base"][k]),
                "head": statistics.median(v),
                "head_over_base": statistics.median(v) / statistics.median(results["base"][k])}
            for k, v in results["head"].items() if k in results["base"]}
    doc = {"base": a.base, "head": head_rev, "rounds": a.rounds, "metrics": rows,
           "raw": results, "failed_runs": FAILURES}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_revisions.json").write_text(json.dumps(doc, indent=1))
    plot(rows, out / "compare_revisions.png", a.base, head_rev)
    for k, r in rows.items():
        log(f"{k:40s} base {r['base']:10.2f}  head {r['head']:10.2f}  x{r['head_over_base']:.3f}")
    return 0


def plot(rows: dict, path: Path, base: str, head: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows)
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(keys) + 1.5))
    ax.barh(keys, [rows[k]["head_over_base"] for k in keys], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"{head} / {base} (1.0 = unchanged; tok/s: higher is better, ms: lower)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
