"""The cost of the NATS boundary (issue 12): three meshes side by side in one run,

  off        no NATS users (anyone on the bus may do anything)
  auth       each service its own user, granted only its subjects (pdmesh.deploy.creds)
  auth+tls   the same over TLS (a CA made for the run; every client verifies the server)

and every measurement goes to each of them back to back, round after round, so machine
noise hits them alike:

  - NATS KV throughput: KV-write-sized requests on decode's KV subject, sent as the
    `prefill` user and answered as the `decode` user (exactly the grant KV writes take;
    off: no users), a window of 8 in flight, like prefill's KvSender;
  - PD TTFT at c=1 and c=16 through the gateway (PD forced), and prefill's own KV
    transfer rate (kv_bytes / kv_transfer_s from its $SRV.STATS) over those requests.

Writes docs/bench/nats_auth_<model>.json and .png with the ratios to `off`.

    .venv/bin/python scripts/bench_nats_auth.py [--rounds 3] [--model models/tiny-target]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

import aiohttp
import nats

from pdmesh.bench.loadgen import completion_body, run_level
from pdmesh.bench.rawnats import log, raw_run, responder_main
from pdmesh.local.cluster import Cluster
from shared import micro, subjects
from shared.natsconn import NatsAuth

ROOT = Path(__file__).resolve().parent.parent


MODES = {"off": {"nats_auth": False}, "auth": {"nats_auth": True},
         "auth+tls": {"nats_auth": True, "nats_tls": True}}
SIZES = (1 << 10, 64 << 10, 1 << 20)       # KV write payloads: tiny, a block group, large
WINDOW = 8
PROMPT = ("def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n" * 24)


# ---- the KV responder: answers as the decode user, in its own process -------------------
class Responder:
    def __init__(self, c: Cluster, subject: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_NATS_")}
        if c.secrets is not None:
            env |= c.secrets.env("decode")
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--responder", subject, c.nats.url], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("KV responder did not start")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


# ---- one mesh ----------------------------------------------------------------------------
class Mesh:
    def __init__(self, name: str, model: str, kw: dict):
        self.name = name
        self.cluster = Cluster(model, prefill=1, decode=1, dtype="float32", threads=1,
                               echo=False, overrides={"decode": {"mode": "pd"}}, **kw)
        self.kv_subject = subjects.decode_kv("bench_" + name.replace("+", "_"))

    async def start(self) -> None:
        await self.cluster.astart()
        c = self.cluster
        self.sender = await nats.connect(**c.client_options("prefill"), pending_size=64 << 20)
        self.looker = await nats.connect(**c.client_options())
        self.responder = await asyncio.to_thread(Responder, c, self.kv_subject)

    async def stop(self) -> None:
        for nc in (self.sender, self.looker):
            await nc.close()
        await asyncio.to_thread(self.responder.close)
        await self.cluster.astop()

    async def kv(self, size: int, total: float) -> float:
        payload = bytes(size)
        await asyncio.gather(*(self.sender.request(self.kv_subject, payload, timeout=10)
                               for _ in range(WINDOW)))          # warm-up
        r = await raw_run(self.sender, self.kv_subject, size, WINDOW, total, 30.0)
        return r["bytes_per_s"]

    async def prefill_kv(self) -> tuple[float, float]:
        per = await micro.service_stats(self.looker, "prefill", expect=1)
        s = per[0] if per else {}
        return s.get("kv_bytes", 0), s.get("kv_transfer_s", 0.0)

    async def ttft(self, http, c: int, n: int) -> dict:
        model = Path(self.cluster.model).name
        bodies = [completion_body(model, PROMPT + f"# {i}\n", "pd", 8) for i in range(n)]
        before = await self.prefill_kv()
        r = await run_level(http, self.cluster.url, bodies, c, f"{self.name} c={c}")
        after = await self.prefill_kv()
        kv_s = after[1] - before[1]
        return {"ttft_p50_s": r["ttft_s"]["p50"], "ttft_p90_s": r["ttft_s"]["p90"],
                "ok": r["ok"], "errors": r["errors"],
                "kv_bytes_per_s": (after[0] - before[0]) / kv_s if kv_s > 0 else None}


# ---- the run -----------------------------------------------------------------------------
async def measure(meshes: list[Mesh], rounds: int, kv_mb: float, n1: int, n16: int) -> dict:
    res = {m.name: {"kv": {str(s): [] for s in SIZES}, "c1": [], "c16": []} for m in meshes}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for m in meshes:                                    # warm every path once
            await m.ttft(http, 1, 2)
        for rnd in range(rounds):
            log(f"round {rnd + 1}/{rounds}")
            for size in SIZES:
                for m in meshes:
                    bps = await m.kv(size, kv_mb * 1e6 * (1 if size >= 64 << 10 else 0.05))
                    res[m.name]["kv"][str(size)].append(bps)
                    log(f"  {m.name:9s} KV {size >> 10:5d} KiB: {bps / 1e6:8.1f} MB/s")
            for level, c, n in (("c1", 1, n1), ("c16", 16, n16)):
                for m in meshes:
                    r = await m.ttft(http, c, n)
                    res[m.name][level].append(r)
                    log(f"  {m.name:9s} {level}: TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms, "
                        f"{r['ok']} ok, {r['errors']} failed")
    return res


def summarize(res: dict) -> dict:
    """Medians over rounds, and ratios to `off` paired within each round (the meshes were
    measured back to back, so a round's load hits all of them): median and range."""
    med = statistics.median
    out = {}
    for name, r in res.items():
        out[name] = {
            "kv_bytes_per_s": {s: med(v) for s, v in r["kv"].items()},
            **{f"ttft_p50_s_{lv}": med(x["ttft_p50_s"] for x in r[lv]) for lv in ("c1", "c16")},
            **{f"prefill_kv_bytes_per_s_{lv}": med(x["kv_bytes_per_s"] or 0 for x in r[lv])
               for lv in ("c1", "c16")},
            "failed": sum(x["errors"] for lv in ("c1", "c16") for x in r[lv]),
        }
    base = res["off"]
    ratios = {}
    for name, r in res.items():
        pairs = {f"kv_{int(s) >> 10}KiB": [a / b for a, b in zip(v, base["kv"][s])]
                 for s, v in r["kv"].items()}
        pairs |= {f"ttft_{lv}": [a["ttft_p50_s"] / b["ttft_p50_s"]
                                 for a, b in zip(r[lv], base[lv])] for lv in ("c1", "c16")}
        ratios[name] = {k: {"median": med(v), "min": min(v), "max": max(v)}
                        for k, v in pairs.items()}
    return {"summary": out, "ratios_to_off": ratios}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, names = report["summary"], list(report["summary"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        kv = [s[n]["kv_bytes_per_s"][str(z)] / 1e6 for z in SIZES]
        a.bar([x + i * w for x in range(len(SIZES))], kv, w, label=n)
        t = [s[n][f"ttft_p50_s_{lv}"] * 1e3 for lv in ("c1", "c16")]
        b.bar([x + i * w for x in range(2)], t, w, label=n)
    a.set_xticks([x + w for x in range(len(SIZES))], [f"{z >> 10} KiB" for z in SIZES])
    a.set_ylabel("MB/s (median of rounds)")
    a.set_title(f"NATS KV throughput, prefill user -> decode user, window {WINDOW}")
    b.set_xticks([x + w for x in range(2)], ["c=1", "c=16"])
    b.set_ylabel("TTFT p50, ms")
    b.set_title("PD TTFT through the gateway")
    for ax in (a, b):
        ax.legend()
    r = report["ratios_to_off"]
    fig.suptitle("cost of the NATS boundary; ratios to off: " + "; ".join(
        f"{n}: KV 64KiB x{r[n]['kv_64KiB']['median']:.2f}, TTFT c1 "
        f"x{r[n]['ttft_c1']['median']:.2f}, c16 x{r[n]['ttft_c16']['median']:.2f}"
        for n in names if n != "off") + " (medians of paired rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args) -> int:
    logging.getLogger("asyncio").setLevel(logging.ERROR)   # nats-py over TLS: eof warnings
    meshes = [Mesh(n, args.model, kw) for n, kw in MODES.items()]
    load_before = os.getloadavg()
    try:
        for m in meshes:
            log(f"starting {m.name}")
            await m.start()
        res = await measure(meshes, args.rounds, args.kv_mb, args.n1, args.n16)
    finally:
        for m in meshes:
            try:
                await m.stop()
            except Exception as e:  # noqa: BLE001 - a mesh that never started
                log(f"stopping {m.name}: {e!r}")
    report = {"model": Path(args.model).name, "rounds": args.rounds, "window": WINDOW,
              "kv_mb_per_measure": args.kv_mb, "requests": {"c1": args.n1, "c16": args.n16},
              "cpus": os.cpu_count(), "load_avg": {"before": load_before,
                                                   "after": os.getloadavg()},
              **summarize(res), "raw": res}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"nats_auth_{report['model']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, stem.with_suffix(".png"))
    log(json.dumps(report["ratios_to_off"], indent=1))
    log(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--responder"]:
        sys.exit(asyncio.run(responder_main(sys.argv[2], sys.argv[3], NatsAuth.from_env())))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kv-mb", type=float, default=96.0, help="MB per KV measurement")
    ap.add_argument("--n1", type=int, default=10, help="requests at c=1 per round")
    ap.add_argument("--n16", type=int, default=32, help="requests at c=16 per round")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    sys.exit(asyncio.run(main(ap.parse_args())))
