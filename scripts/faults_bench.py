"""Faults benchmark (invariant 7), through `pdmesh up` itself: the product as a user launches
it (a subprocess; children killed by pid, `pdmesh restart SERVICE`), under 16 concurrent greedy
streams on the tiny model, one fault per scenario, injected only once it is proven in flight.
Reported in the table of Dynamo's fault tests: requests, succeeded, failed, wrong (outputs
other than the engine alone's, deterministic mode), recovery seconds (a killed child running
again and the mesh ready). JSON + PNG.

    python scripts/faults_bench.py [--scenarios kill_decode,rolling_gateway,...] [--requests 48]

  kill_decode      kill -9 one of 2 decodes once 8 streams are mid-generation
  kill_prefill     kill -9 one of 2 prefills while its KV writes are on the wire
  kill_nats_node   kill -9 one node of a 3-node NATS cluster (R3 work queue)
  restart_nats     `pdmesh restart nats`: every node in turn, same ports and store
  rolling_<svc>    `pdmesh restart <svc>` (decode, prefill, kvstore, gateway)
  kill_gateway     kill -9 the gateway mid-stream: its clients' streams die with its sockets;
                   recovery: the gateway back and the next requests correct
  overload         160 clients (10x the decode's batch) for 30 s, each waiting Retry-After
                   after a 429: the excess gets 429; admitted requests' p99 vs unloaded p99
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from pdmesh.bench.workloads import CODE_PROMPTS
from pdmesh.chaos.faultload import Load, metric, pct, references
from pdmesh.local.launched import UpMesh
from shared import micro
from shared.faults import ALLOW_ENV

ROOT = Path(__file__).resolve().parents[1]


MODEL = ROOT / "models" / "tiny-target"
MAX_TOKENS = 64
MESH = ("--model", str(MODEL), "--prefill", "2", "--decode", "2", "--nats-cluster", "3",
        "--deterministic", "--dtype", "float32",
        "--set", "prefill.fault_kv_write_delay_s=0.01", "--set", "prefill.kv_max_write_bytes=16384")


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- faults: each awaits its moment, injects, and returns the recovery seconds -------------------
def kill(name: str, when=None):
    async def fault(m: UpMesh, load: Load) -> float:
        await (when(m) if when else load.mid_stream())
        child = m.gateway_name() if name == "gateway" else name
        log(f"kill -9 {child}")
        old = m.sigkill(child)
        t0 = time.monotonic()
        await m.back(child, old, timeout_s=120)
        return time.monotonic() - t0
    return fault


async def prefill_writing(m: UpMesh) -> None:
    """Until prefill-0 has KV writes on the wire."""
    nc = await m.nats()
    try:
        while True:
            mine = [i.stats for i in await micro.stats(nc, "prefill", 0.1)
                    if i.instance_id == "prefill_0"]
            if mine and mine[0].get("kv_writes_in_flight", 0) > 0:
                return
    finally:
        await nc.close()


def rolling(service: str):
    async def fault(m: UpMesh, load: Load) -> float:
        await load.mid_stream()
        log(f"pdmesh restart {service}")
        t0 = time.monotonic()
        code, out = await m.restart(service)
        if code != 0:
            raise RuntimeError(out)
        return time.monotonic() - t0
    return fault


SCENARIOS = {
    "kill_decode": kill("decode-1"),
    "kill_prefill": kill("prefill-0", prefill_writing),
    "kill_nats_node": kill("nats-1"),
    "restart_nats": rolling("nats"),
    **{f"rolling_{s}": rolling(s) for s in ("decode", "prefill", "kvstore", "gateway")},
}


async def scenario(m: UpMesh, name: str, n: int, refs, prompts) -> dict:
    load = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
    migrated0 = await metric(m.url, "pdmesh_migrations_total")
    t0 = time.monotonic()
    runner = asyncio.ensure_future(load.run(n))
    recovery = await SCENARIOS[name](m, load)
    await runner
    migrated = int(await metric(m.url, "pdmesh_migrations_total") - migrated0)
    return row(name, load, refs, recovery, time.monotonic() - t0,   # a new gateway counts anew
               migrated=migrated if migrated >= 0 else None)


async def kill_gateway(m: UpMesh, n: int, refs, prompts) -> dict:
    """The streams on a killed gateway end with its sockets (nothing can answer them): what
    counts is the gateway back on its port and the next requests correct."""
    cut = Load(m.url, prompts, "tiny-target", 3000)
    runner = asyncio.ensure_future(cut.run(16))
    recovery = await kill("gateway")(m, cut)
    await asyncio.wait_for(runner, 60)
    after = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
    await after.run(n)
    return row("kill_gateway", after, refs, recovery, 0.0, streams_cut=len(cut.failed()))


def row(name: str, load: Load, refs, recovery: float | None, wall_s: float, **extra) -> dict:
    res = load.results
    failed, wrong = load.failed(), load.wrong(refs)
    return {"scenario": name, "requests": len(res), "succeeded": len(res) - len(failed),
            "failed": len(failed), "wrong": len(wrong),
            "recovery_s": round(recovery, 2) if recovery is not None else None,
            "max_stall_s": round(max((r["max_stall_s"] for r in res), default=0), 3),
            "wall_s": round(wall_s, 2), "error_samples": [r["error"] for r in failed[:3]]
            } | extra


async def overload(seconds: float, prompts) -> dict:
    """16 streams unloaded, then 160 clients for `seconds`: 429s, and the admitted ones' p99
    (admission at 1.5x the decode's batch: --set gateway.max_in_flight=24)."""
    async with UpMesh("--model", str(MODEL), "--set", "gateway.max_in_flight=24") as m:
        base = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
        await base.run(32, 16)
        p99 = pct([r["latency_s"] for r in base.results], 0.99)
        load = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
        stop = time.monotonic() + seconds
        ids = iter(range(1 << 30))

        async def worker(http):      # a client that honours Retry-After, as it should
            while time.monotonic() < stop:
                await load.one(http, next(ids))
                if load.results[-1]["status"] == 429:
                    await asyncio.sleep(1.0)

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(worker(http) for _ in range(160)))
    ok = [r for r in load.results if r["status"] == 200 and r["error"] is None]
    refused = [r for r in load.results if r["status"] == 429]
    return {"scenario": "overload", "requests": len(load.results), "succeeded": len(ok),
            "refused_429": len(refused), "failed": len(load.results) - len(ok) - len(refused),
            "wrong": 0, "recovery_s": None,
            "refused_p99_s": round(pct([r["latency_s"] for r in refused], 0.99), 3),
            "unloaded_p99_s": round(p99, 3),
            "admitted_p99_s": round(pct([r["latency_s"] for r in ok], 0.99), 3)}


def table(rows: list[dict]) -> str:
    head = "| scenario | requests | succeeded | failed | wrong | recovery (s) |\n|---|---|---|---|---|---|"
    return "\n".join([head] + [
        f"| {r['scenario']} | {r['requests']} | {r['succeeded']} | {r['failed']} | {r['wrong']} "
        f"| {r['recovery_s'] if r['recovery_s'] is not None else '-'} |" for r in rows])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("failed", "wrong", "recovery_s"),
                              ("failed requests", "wrong outputs", "recovery (s)")):
        vals = [r.get(key) or 0 for r in rows]
        bars = ax.bar(names, vals, color="tab:red" if key != "recovery_s" else "tab:blue")
        ax.bar_label(bars, labels=[f"{v:g}" for v in vals], fontsize=7)
        ax.set_ylim(0, max(1.0, max(vals, default=0) * 1.2))
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=40, labelsize=8)
    fig.suptitle("pdmesh up under faults (16 concurrent greedy streams, tiny model; "
                 "2 prefill, 2 decode, 3 NATS nodes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(a) -> list[dict]:
    from services.decode.config import DecodeConfig
    from shared.engine.tokenizer import Tokenizer
    from shared.settings import load

    tok = Tokenizer.from_pretrained(str(MODEL))
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    names = a.scenarios.split(",")
    rows = []
    mesh_names = [n for n in names if n in SCENARIOS or n == "kill_gateway"]
    if mesh_names:
        async with UpMesh(*MESH, env={ALLOW_ENV: "1"}) as m:
            argv = Path(f"/proc/{m.pid('decode-0')}/cmdline").read_bytes().split(b"\0")
            engine = load(DecodeConfig, [x.decode() for x in argv if x][3:]).engine
            refs = references(engine, prompts, MAX_TOKENS)
            for name in mesh_names:
                log(f"scenario {name}")
                r = (await kill_gateway(m, a.requests, refs, prompts) if name == "kill_gateway"
                     else await scenario(m, name, a.requests, refs, prompts))
                log(json.dumps(r))
                rows.append(r)
    if "overload" in names:
        log("scenario overload")
        rows.append(await overload(a.overload_s, prompts))
        log(json.dumps(rows[-1]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join([*SCENARIOS, "kill_gateway", "overload"]))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--overload-s", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    a = ap.parse_args()
    rows = asyncio.run(main_async(a))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults_up_tiny-target.json").write_text(json.dumps(
        {"launched_by": "pdmesh up", "mesh": list(MESH), "max_tokens": MAX_TOKENS,
         "scenarios": rows}, indent=1))
    plot(rows, out / "faults_up_tiny-target.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
