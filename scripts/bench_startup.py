"""What a mesh's start and a service's restart cost, with the fork server (every service
forked from one process that imported torch, transformers, xgrammar... once:
pdmesh/local/zygote.py) and without (each service its own `python -m services.X`), the
two interleaved in one run.

Per round and mode, a local mesh (kvstore, 1 prefill, 1 decode, gateway) on --model:
  start_s     Cluster start until GET /ready and $SRV.PING find every instance
  restart_s   decode-0 SIGKILLed and started again, until ready again
  cpu_s       CPU seconds of every child process (nats-server included), start to stop

    python scripts/bench_startup.py [--model models/tiny-target] [--rounds 3] [--warmup 1]

Writes docs/bench/startup.json and .png.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from pdmesh.bench.report import save
from pdmesh.local.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
MODES = {"fork server": True, "python -m each": False}


def log(msg: str) -> None:
    print(f"[startup {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(model: str, fork: bool) -> dict:
    cpu0, t0 = children_cpu(), time.monotonic()
    c = Cluster(model, prefill=1, decode=1, deterministic=True, dtype="float32", threads=1,
                echo=False, fork_server=fork)
    c.start()
    try:
        start_s = time.monotonic() - t0
        c.kill("decode-0")
        t1 = time.monotonic()
        c.restart("decode-0")
        restart_s = time.monotonic() - t1
    finally:
        c.stop()
    return {"start_s": start_s, "restart_s": restart_s, "cpu_s": children_cpu() - cpu0}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("start_s", "restart_s", "cpu_s")
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, key in zip(axes, keys):
        names = list(res["median"])
        ax.bar(names, [res["median"][n][key] for n in names], color=["tab:green", "tab:gray"])
        for i, n in enumerate(names):
            ax.plot([i] * len(res["rounds"][n]), [r[key] for r in res["rounds"][n]], "k.")
        ax.set_title(key.replace("_s", " (s)"))
    fig.suptitle(f"mesh start and decode restart, {res['model']} ({res['n']} rounds, "
                 "median bars, rounds dots)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (caches)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(a.warmup):
        for fork in MODES.values():
            one(a.model, fork)
        log(f"warm-up round {i + 1}/{a.warmup} done")
    for i in range(a.rounds):
        for name, fork in (MODES.items() if i % 2 == 0 else reversed(MODES.items())):
            r = one(a.model, fork)
            rounds[name].append(r)
            log(f"round {i + 1}/{a.rounds} {name}: start {r['start_s']:.2f} s, restart "
                f"{r['restart_s']:.2f} s, children's CPU {r['cpu_s']:.1f} s")
    median = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
              for n, rs in rounds.items()}
    ratio = {k: median["fork server"][k] / median["python -m each"][k]
             for k in median["fork server"]}
    res = {"model": Path(a.model).name, "n": a.rounds, "rounds": rounds, "median": median,
           "fork_over_popen": ratio}
    log("median: " + ", ".join(f"{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items())
                               for n, m in median.items()))
    log("fork server / python -m each: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    log(f"wrote {save(res, a.out, 'startup', plot)}.json and .png")


if __name__ == "__main__":
    main()
