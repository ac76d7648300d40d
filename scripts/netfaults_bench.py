"""Faults across a network (issue 30), in Dynamo's fault-test format: `pdmesh up` on this
host (3 clustered nats-servers listening for other hosts, kvstore, prefill-0, decode-0,
the gateway), plus decode_b and prefill_b each on its own host of a network lab
(pdmesh/chaos/netlab.py: a namespace with its own hostname and /dev/shm, over a veth pair),
started as an operator adds them (their service's command line and NATS user).

    sudo python scripts/netfaults_bench.py [--scenarios kill_decode_b,cut_decode_b_5s,...]

  kill_decode_b          kill -9 decode_b under load, then start it again
  cut_<host>_<N>s        the host's link drops every packet for N s (decode_b, prefill_b)
  cut_nats_node_<N>s     one nats-server of three cut off (its client and route ports):
                         a minority partition
  loss_decode_b_<P>pct   P% of decode_b's packets lost at random, for the whole load
  rate_prefill_b_1gbit   prefill_b's link (its KV writes) limited to 1 Gbit/s

Each: 48 greedy requests, 16 at a time, 64 tokens, --deterministic, the tiny model. A
request fails on an HTTP error, an error event or a lost connection; it is wrong when it
completes with other tokens than the engine alone's. recovery: from the heal (or the
restart) until both decodes and both prefills answer and the gateway counts 2 decodes.
leaked: blocks decode_b still holds 30 s after the load ended (0 expected). Delay
(tc netem) is not in this kernel: where it is, add `delay` scenarios with Host.shape().
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

from pdmesh.bench.workloads import CODE_PROMPTS
from pdmesh.chaos import netlab
from pdmesh.chaos.faultload import Load, metric, references
from pdmesh.local.launched import UpMesh
from shared import micro

ROOT = Path(__file__).resolve().parents[1]


MODEL = ROOT / "models" / "tiny-target"
MAX_TOKENS = 64
MESH = ("--model", str(MODEL), "--nats-cluster", "3", "--nats-host", "0.0.0.0",
        "--deterministic")
SCENARIOS = ["kill_decode_b", "cut_decode_b_5s", "cut_decode_b_30s", "cut_prefill_b_5s",
             "cut_prefill_b_30s", "cut_nats_node_5s", "cut_nats_node_30s",
             "loss_decode_b_1pct", "loss_decode_b_5pct", "rate_prefill_b_1gbit"]


def log(msg: str) -> None:
    print(f"[netfaults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Lab:
    """The mesh, its two hosts and the instances on them."""

    def __init__(self, m: UpMesh, lab: netlab.NetLab):
        self.m, self.lab = m, lab
        self.hosts = {"decode_b": lab.host("b"), "prefill_b": lab.host("p")}
        self.procs = {}

    def spawn(self, iid: str) -> None:
        child = "decode-0" if iid.startswith("decode") else "prefill-0"
        host = self.hosts[iid]
        self.procs[iid] = self.m.spawn_like(child, iid, nats_host=host.peer, wrap=host.command)

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()

    async def serving(self, timeout_s: float = 120) -> float:
        """Seconds until the gateway counts 2 decodes and every instance answers PING."""
        import aiohttp

        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            while True:
                try:
                    async with http.get(self.m.url + "/ready") as r:
                        n = (await r.json()).get("decode_instances")
                    nc = await self.m.nats()
                    try:
                        ids = {i.instance_id for s in ("decode", "prefill")
                               for i in await micro.ping(nc, s, 0.3)}
                    finally:
                        await nc.close()
                    if n == 2 and {"decode_b", "prefill_b", "decode_0", "prefill_0"} <= ids:
                        return time.monotonic() - t0
                except (OSError, asyncio.TimeoutError, ConnectionError):
                    pass
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the mesh does not serve on both hosts in {timeout_s} s")
                await asyncio.sleep(0.2)

    async def blocks_used(self, iid: str) -> int:
        nc = await self.m.nats()
        try:
            found = [i for i in await micro.stats(nc, "decode", 0.5) if i.instance_id == iid]
        finally:
            await nc.close()
        return found[0].stats["blocks_used"] if found else -1


async def fault(lab: Lab, name: str, load: Load) -> float | None:
    """Inject the fault once the load is mid-stream; the recovery seconds (None: a fault
    that lasts the whole load)."""
    await load.mid_stream()
    m = re.fullmatch(r"cut_(decode_b|prefill_b|nats_node)_(\d+)s", name)
    if name == "kill_decode_b":
        log("kill -9 decode_b")
        lab.procs["decode_b"].kill()
        lab.procs["decode_b"].wait()
        lab.spawn("decode_b")                 # the operator (or its supervisor) restarts it
        return await lab.serving()
    if m:
        who, secs = m.group(1), int(m.group(2))
        cut = (netlab.PortCut(lab.m.nats_node_ports("nats-1"), "n1") if who == "nats_node"
               else lab.hosts[who])
        log(f"cut {who} for {secs} s")
        cut.cut()
        try:
            await asyncio.sleep(secs)
        finally:
            cut.heal()
        return await lab.serving()
    m = re.fullmatch(r"loss_decode_b_(\d+)pct", name)
    if m:
        lab.hosts["decode_b"].shape(loss_pct=float(m.group(1)))
        return None
    if name == "rate_prefill_b_1gbit":
        lab.hosts["prefill_b"].shape(rate="1gbit")
        return None
    raise ValueError(f"unknown scenario {name}")


async def scenario(lab: Lab, name: str, n: int, refs, prompts) -> dict:
    load = Load(lab.m.url, prompts, "tiny-target", MAX_TOKENS)
    migrated0 = await metric(lab.m.url, "pdmesh_migrations_total")
    t0 = time.monotonic()
    runner = asyncio.ensure_future(load.run(n))
    try:
        recovery = await fault(lab, name, load)
        await runner
    finally:
        for h in lab.hosts.values():
            h.heal()
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while (leaked := await lab.blocks_used("decode_b")) != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    res = load.results
    failed, wrong = load.failed(), load.wrong(refs)
    return {"scenario": name, "requests": len(res), "succeeded": len(res) - len(failed),
            "failed": len(failed), "wrong": len(wrong),
            "recovery_s": round(recovery, 2) if recovery is not None else None,
            "leaked_blocks": leaked,
            "migrated": int(await metric(lab.m.url, "pdmesh_migrations_total") - migrated0),
            "max_stall_s": round(max((r["max_stall_s"] for r in res), default=0), 3),
            "p50_latency_s": round(sorted(r["latency_s"] for r in res)[len(res) // 2], 3),
            "wall_s": round(wall, 2), "error_samples": [r["error"] for r in failed[:3]]}


def table(rows: list[dict]) -> str:
    head = ("| scenario | requests | succeeded | failed | wrong | recovery (s) | leaked blocks |"
            " migrated | p50 latency (s) |\n|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [
        f"| {r['scenario']} | {r['requests']} | {r['succeeded']} | {r['failed']} | {r['wrong']} "
        f"| {r['recovery_s'] if r['recovery_s'] is not None else '-'} | {r['leaked_blocks']} "
        f"| {r['migrated']} | {r['p50_latency_s']} |" for r in rows])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, key, title in zip(axes, ("failed", "wrong", "recovery_s", "p50_latency_s"),
                              ("failed requests", "wrong outputs", "recovery after heal (s)",
                               "p50 request latency (s)")):
        vals = [r.get(key) or 0 for r in rows]
        bars = ax.bar(names, vals, color="tab:red" if key in ("failed", "wrong") else "tab:blue")
        ax.bar_label(bars, labels=[f"{v:g}" for v in vals], fontsize=7)
        ax.set_ylim(0, max(1.0, max(vals, default=0) * 1.2))
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.suptitle("pdmesh across a network lab: decode_b and prefill_b on their own hosts "
                 "(48 greedy requests, 16 at a time, tiny model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(a) -> list[dict]:
    from services.decode.config import DecodeConfig
    from shared.engine.tokenizer import Tokenizer
    from shared.settings import load

    tok = Tokenizer.from_pretrained(str(MODEL))
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    rows = []
    with netlab.NetLab() as nl:
        async with UpMesh(*MESH) as m:
            lab = Lab(m, nl)
            try:
                lab.spawn("decode_b")
                lab.spawn("prefill_b")
                log(f"decode_b and prefill_b serve after {await lab.serving(180):.1f} s")
                argv = Path(f"/proc/{m.pid('decode-0')}/cmdline").read_bytes().split(b"\0")
                engine = load(DecodeConfig, [x.decode() for x in argv if x][3:]).engine
                refs = references(engine, prompts, MAX_TOKENS)
                for name in a.scenarios.split(","):
                    log(f"scenario {name}")
                    rows.append(await scenario(lab, name, a.requests, refs, prompts))
                    log(json.dumps(rows[-1]))
            finally:
                lab.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    a = ap.parse_args()
    why = netlab.reason()
    if why:
        print(f"netfaults_bench: no network lab here: {why}", file=sys.stderr)
        return 2
    rows = asyncio.run(main_async(a))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "netfaults.json").write_text(json.dumps(
        {"launched_by": "pdmesh up + netlab hosts", "mesh": list(MESH),
         "hosts": {"decode_b": "own namespace", "prefill_b": "own namespace"},
         "max_tokens": MAX_TOKENS, "netem": netlab.netem_reason() or "available",
         "scenarios": rows}, indent=1))
    plot(rows, out / "netfaults.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
