"""Faults benchmark (invariant 7): under 16 concurrent greedy streams on the tiny model,
one fault per scenario, injected only once it is proven in flight. Each scenario reports
requests, failed, migrated, the longest stall a client saw between two events, and how
many outputs differ from the engine alone (deterministic mode). JSON + PNG.

    python scripts/faults_bench.py [--scenarios kill_decode,kill_prefill,...] [--requests 48]

  kill_decode     SIGKILL 1 of 2 decodes once 8 streams are mid-generation: 0 failed,
                  every output equals its reference (requests migrate with their tokens)
  kill_prefill    SIGKILL 1 of 2 prefills while its KV writes are on the wire: 0 failed
  kill_nats_node  SIGKILL 1 node of a 3-node NATS cluster (R3 work queue): 0 failed
  restart_nats    a single nats-server down for 1 s: every response equals its reference
                  or ends in an explicit error; none waits > 10 s
  kill_gateway    SIGKILL the gateway mid-stream: decode `running` back to 0 within 10 s
  overload        160 clients (10x the decode's batch) for 30 s, each waiting Retry-After
                  after a 429: the excess gets 429 within 1 s; admitted requests' p99
                  latency <= 2x the unloaded p99 (16 clients)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdmesh.cluster import Cluster  # noqa: E402
from shared import micro  # noqa: E402
from shared.faults import ALLOW_ENV  # noqa: E402
from tests.conftest import CODE_PROMPTS  # noqa: E402

MODEL = ROOT / "models" / "tiny-target"
SHAPES = {"max_num_batched_tokens": 128, "chunk_size": 32, "block_size": 16}
DET = dict(deterministic=True, dtype="float32", threads=1)
GATEWAY = {"decode_dead_after_s": 2.0, "progress_timeout_s": 5.0}
MAX_TOKENS = 64


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Load:
    """Streams of greedy completions; what each request got, and when."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.results: list[dict] = []
        self.streaming: dict[int, int] = {}    # request -> tokens so far (live ones)

    async def one(self, http, i: int) -> None:
        body = {"model": "tiny-target", "prompt": self.prompts[i % len(self.prompts)],
                "stream": True, "return_token_ids": True, "temperature": 0.0,
                "max_tokens": self.max_tokens, "ignore_eos": True}
        r = {"i": i, "tokens": [], "error": None, "status": 0, "max_stall_s": 0.0}
        t0 = last = time.monotonic()
        try:
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                r["status"] = resp.status
                if resp.status != 200:
                    r["error"] = (await resp.json())["error"]
                else:
                    await self._read(resp, r, i, last)
        except Exception as e:  # noqa: BLE001 - a lost connection is a failure
            r["error"] = {"message": repr(e)}
        self.streaming.pop(i, None)
        r["latency_s"] = time.monotonic() - t0
        self.results.append(r)

    async def _read(self, resp, r: dict, i: int, last: float) -> None:
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            r["max_stall_s"] = max(r["max_stall_s"], now - last)
            last = now
            ev = json.loads(line[6:])
            if "error" in ev:
                r["error"] = ev["error"]
                return
            for ch in ev["choices"]:
                r["tokens"] += ch.get("token_ids") or []
            self.streaming[i] = len(r["tokens"])

    async def run(self, n: int, concurrency: int = 16) -> None:
        todo = iter(range(n))

        async def worker(http):
            for i in todo:
                await self.one(http, i)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            await asyncio.gather(*(worker(http) for _ in range(concurrency)))

    async def mid_stream(self, streams: int = 8, tokens: int = 4, timeout_s: float = 60) -> None:
        """Until `streams` requests have each received at least `tokens` tokens."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for n in self.streaming.values() if n >= tokens) < streams:
            if time.monotonic() > deadline:
                raise TimeoutError("the load never got going")
            await asyncio.sleep(0.02)


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def references(prompts: list[list[int]]) -> list[list[int]]:
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(MODEL), num_blocks=512, max_num_seqs=16, **DET,
                                 **SHAPES))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o["token_ids"] for o in eng.generate(prompts, sp)]


def summarize(name: str, load: Load, refs, migrated: float, t: float, **extra) -> dict:
    res = load.results
    failed = [r for r in res if r["error"] is not None]
    wrong = [r["i"] for r in res if r["error"] is None
             and r["tokens"] != refs[r["i"] % len(refs)]]
    out = {"scenario": name, "requests": len(res), "failed": len(failed), "wrong": len(wrong),
           "migrated": int(migrated), "max_stall_s": round(max(r["max_stall_s"] for r in res), 3),
           "max_latency_s": round(max(r["latency_s"] for r in res), 3), "wall_s": round(t, 2),
           "error_samples": [r["error"] for r in failed[:3]]}
    return out | extra


def cluster(**kw) -> Cluster:
    over = kw.pop("overrides", {})
    decode = SHAPES | {"max_num_seqs": 16} | over.pop("decode", {})
    prefill = SHAPES | {"ack_wait_s": 3.0} | over.pop("prefill", {})
    return Cluster(str(MODEL), **DET, echo=False, extra_env={ALLOW_ENV: "1"},
                   overrides={"decode": decode, "prefill": prefill,
                              "gateway": GATEWAY | over.pop("gateway", {})} | over, **kw)


async def with_fault(c: Cluster, load: Load, n: int, inject) -> float:
    t0 = time.monotonic()
    runner = asyncio.ensure_future(load.run(n))
    await inject(c, load)
    await runner
    return time.monotonic() - t0


# ---- scenarios ------------------------------------------------------------------------------
async def kill_decode(c, load):
    await load.mid_stream()
    log("8 streams mid-generation: SIGKILL decode-0")
    c.kill("decode-0")


async def kill_prefill(c, load):
    deadline = time.monotonic() + 60
    nc = await micro.connect_once(c.nats_url)
    try:
        while True:        # proven in flight: prefill-0 has KV writes on the wire right now
            mine = [i.stats for i in await micro.stats(nc, "prefill", 0.2)
                    if i.instance_id == "prefill_0"]
            if mine and mine[0].get("kv_writes_in_flight", 0) > 0:
                break
            assert time.monotonic() < deadline, "prefill-0 never had a write in flight"
            await asyncio.sleep(0.01)
    finally:
        await nc.close()
    log("prefill-0 has KV writes in flight: SIGKILL")
    c.kill("prefill-0")


async def kill_nats_node(c, load):
    await load.mid_stream()
    log("8 streams mid-generation: SIGKILL nats-1")
    c.kill("nats-1")


async def restart_nats(c, load):
    await load.mid_stream()
    log("8 streams mid-generation: nats-server down for 1 s")
    await c.arestart_nats(down_s=1.0)


SCENARIOS = {   # name -> (cluster settings, fault)
    "kill_decode": ({"prefill": 1, "decode": 2}, kill_decode),
    "kill_prefill": ({"prefill": 2, "decode": 1, "mode": "pd", "overrides": {
        "prefill": {"fault_kv_write_delay_s": 0.02, "kv_max_write_bytes": 16 << 10}}},
        kill_prefill),
    "kill_nats_node": ({"prefill": 1, "decode": 2, "nats_cluster": 3}, kill_nats_node),
    "restart_nats": ({"prefill": 1, "decode": 1}, restart_nats),
}


async def fault_scenario(name: str, n: int, refs, prompts) -> dict:
    settings, inject = SCENARIOS[name]
    async with cluster(**settings) as c:
        load = Load(c.url, prompts)
        t = await with_fault(c, load, n, inject)
        migrated = await metric(c.url, "pdmesh_migrations_total")
    return summarize(name, load, refs, migrated, t)


async def kill_gateway_scenario(n: int, refs, prompts) -> dict:
    async with cluster(prefill=1, decode=1, overrides={
            "decode": {"gateway_dead_after_s": 2.0}}) as c:
        load = Load(c.url, prompts, max_tokens=3000)
        runner = asyncio.ensure_future(load.run(16))
        await load.mid_stream()
        c.kill("gateway-0")
        t0 = time.monotonic()
        while (await micro.total_stats(c.nats_url, "decode", 0.2)).get("running", 1) > 0:
            await asyncio.sleep(0.2)
            if time.monotonic() - t0 > 60:
                break
        idle_after = time.monotonic() - t0
        await asyncio.wait_for(runner, 60)
    # the clients' connections die with the gateway (nothing can answer them): what counts
    # is that decode stops generating for nobody
    return {"scenario": "kill_gateway", "requests": 16, "decode_idle_after_s": round(idle_after, 2),
            "client_connections_lost": len(load.results), "failed": 0, "migrated": 0,
            "wrong": 0, "max_stall_s": 0.0}


async def overload_scenario(seconds: float, refs, prompts) -> dict:
    """16 streams unloaded, then 160 for `seconds`: 429s, and the admitted ones' p99."""
    # admission at 1.5x the decode's batch (24): the latency bound the target asks for
    async with cluster(prefill=1, decode=1, overrides={"gateway": {"max_in_flight": 24}}) as c:
        base = Load(c.url, prompts)
        await base.run(32, 16)
        p99 = pct([r["latency_s"] for r in base.results], 0.99)
        load = Load(c.url, prompts)
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
    return {"scenario": "overload", "requests": len(load.results), "admitted": len(ok),
            "refused_429": len(refused), "failed": len(load.results) - len(ok) - len(refused),
            "refused_max_s": round(max((r["latency_s"] for r in refused), default=0), 3),
            "refused_p99_s": round(pct([r["latency_s"] for r in refused], 0.99), 3),
            "unloaded_p99_s": round(p99, 3),
            "admitted_p99_s": round(pct([r["latency_s"] for r in ok], 0.99), 3),
            "migrated": 0, "wrong": 0, "max_stall_s": 0.0}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("failed", "migrated", "max_stall_s"),
                              ("failed requests", "migrated requests", "longest client stall (s)")):
        ax.bar(names, [r.get(key, 0) for r in rows], color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle("pdmesh under faults (16 concurrent greedy streams, tiny model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(a) -> list[dict]:
    prompts = [p for p in _prompts()]
    refs = references(prompts)
    rows = []
    for name in a.scenarios.split(","):
        log(f"scenario {name}")
        if name == "kill_gateway":
            row = await kill_gateway_scenario(16, refs, prompts)
        elif name == "overload":
            row = await overload_scenario(a.overload_s, refs, prompts)
        else:
            row = await fault_scenario(name, a.requests, refs, prompts)
        log(json.dumps(row))
        rows.append(row)
    return rows


def _prompts() -> list[list[int]]:
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(MODEL))
    return [tok.encode(p) for p in CODE_PROMPTS]


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
    (out / "faults_tiny-target.json").write_text(json.dumps({"scenarios": rows}, indent=1))
    plot(rows, out / "faults_tiny-target.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
