"""Chaos run for invariant 3 (no KV slot is reused while a write to it can still land).

A real mesh (deterministic mode, tiny model): decode with a small KV pool so freed blocks
are handed out again at once, prefill with random delays on every KV write (so writes are
still on the wire when aborts come) and small KV messages (several writes per job). Load
over HTTP from a fixed pool of distinct (prompt, params) requests, many cancelled by the
client at a random moment (right after submit too), abort storms (a burst of requests all
cancelled at once), and one prefill SIGKILLed mid-run and restarted. Every request that
completes must equal its reference (the engine alone) token for token; afterwards decode
must be quiescent with no block used or quarantined, and every service healthy.

    run(ChaosConfig(model=..., requests=1000)) -> dict of the numbers
    python scripts/chaos.py --requests 10000 [--no-reclaim-ack] [--no-epoch-fence]

The two guards can be switched off (test-only config switches) to show the run detects
the corruption they prevent.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

from shared import micro

PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
    "# Sort a list of numbers\n", "def is_prime(n):\n    if n < 2:", "try:\n    import json",
    "def __repr__(self):", "while True:\n    line = input()", "x = [i * i for i in",
    "def parse_args(argv):", "if __name__ == '__main__':", "from collections import",
    "def add(a, b):\n    return", "async def fetch(url):", "The capital of France is",
]
# prefill and decode share every shape-affecting engine setting (batch-invariant logits)
DET = dict(deterministic=True, dtype="float32", threads=1)
SHAPES = {"max_num_batched_tokens": 128, "chunk_size": 32, "block_size": 16}


@dataclass
class ChaosConfig:
    model: str
    requests: int = 1000
    concurrency: int = 16
    abort_rate: float = 0.4          # share of requests the client cancels
    distinct: int = 40               # distinct (prompt, params): references are computed once
    max_tokens: tuple[int, int] = (6, 16)
    storms: int = 3                  # abort storms spread over the run
    storm_size: int = 24             # requests in each storm, all cancelled at one moment
    prefill: int = 2
    kill_prefill: bool = True        # SIGKILL prefill-1 at 40% of the run, then restart it
    num_blocks: int = 48             # decode's KV pool
    write_delay_s: float = 0.1       # prefill: each KV write waits random 0..this once issued
    kv_max_write_bytes: int = 16384  # prefill: two layers of one block per write (tiny model)
    kv_window: int = 2
    reclaim_ack: bool = True
    epoch_fence: bool = True
    lease_s: float = 3.0
    quiesce_s: float = 30.0
    seed: int = 0
    log_dir: str | None = None
    echo: bool = False


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0               # cancelled by this client before completing
    storm_requests: int = 0
    errors: int = 0
    mismatches: int = 0
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the request pool and its references ------------------------------------------------
def request_pool(model: str, cfg: ChaosConfig) -> list[tuple[list[int], dict]]:
    """cfg.distinct (prompt ids, params): lengths of 1 to 4 KV blocks, greedy and seeded."""
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model)
    rng = random.Random(cfg.seed)
    pool = []
    for i in range(cfg.distinct):
        ids = tok.encode(PROMPTS[i % len(PROMPTS)]) * (1 + i % 4)
        ids = ids[:60]
        mt = rng.randint(*cfg.max_tokens)
        if i % 2 == 0:
            params = dict(temperature=0.0, max_tokens=mt)
        else:
            params = dict(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=mt)
        pool.append((ids, params | {"ignore_eos": True}))
    return pool


def references(model: str, pool) -> list[list[int]]:
    """Each pool entry's output from the engine alone, configured like the mesh's decode."""
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, num_blocks=512, max_num_seqs=16, **DET, **SHAPES))
    outs = eng.generate([p for p, _ in pool], [SamplingParams(**kw) for _, kw in pool])
    return [o["token_ids"] for o in outs]


# ---- the mesh -----------------------------------------------------------------------------
def cluster(cfg: ChaosConfig):
    from pdmesh.cluster import Cluster
    from shared.faults import ALLOW_ENV

    decode = SHAPES | {"max_num_seqs": 16, "mode": "pd", "num_blocks": cfg.num_blocks,
                       "reclaim_lease_s": cfg.lease_s, "reclaim_timeout_s": 0.5,
                       "fault_no_reclaim_ack": not cfg.reclaim_ack,
                       "fault_no_epoch_fence": not cfg.epoch_fence}
    prefill = SHAPES | {"ack_wait_s": 3.0, "max_num_seqs": 8, "kv_window": cfg.kv_window,
                        "kv_max_write_bytes": cfg.kv_max_write_bytes,
                        "fault_kv_write_delay_s": cfg.write_delay_s}
    return Cluster(cfg.model, prefill=cfg.prefill, decode=1, kvstore=False, **DET,
                   overrides={"decode": decode, "prefill": prefill}, echo=cfg.echo,
                   log_dir=cfg.log_dir, extra_env={ALLOW_ENV: "1"})   # the guard switches


async def one(http, url: str, prompt: list[int], params: dict, stream: bool) -> list[int]:
    body = {"model": "tiny-target", "prompt": prompt, "return_token_ids": True,
            "stream": stream, **params}
    async with http.post(url + "/v1/completions", json=body) as r:
        if not stream:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data}")
            return data["choices"][0]["token_ids"]
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        toks: list[int] = []
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            for ch in chunk["choices"]:
                toks += ch.get("token_ids") or []
        return toks


def abort_delay(rng: random.Random) -> float:
    """When the client gives up: right after submit (KV not yet written), while the KV is
    on the wire, or during decode."""
    kind = rng.random()
    if kind < 0.3:
        return rng.uniform(0.0, 0.01)
    if kind < 0.7:
        return rng.uniform(0.01, 0.15)
    return rng.uniform(0.15, 0.8)


async def load(cfg: ChaosConfig, c, pool, want) -> Tally:
    return await _Load(cfg, c, pool, want).run()


class _Load:
    """Requests from the pool at cfg.concurrency (a share of them cancelled by the client),
    abort storms spread over the run, and one prefill SIGKILLed mid-transfer."""

    def __init__(self, cfg: ChaosConfig, c, pool, want):
        self.cfg, self.c, self.pool, self.want = cfg, c, pool, want
        self.rng = random.Random(cfg.seed + 1)
        self.t = Tally()
        self.sem = asyncio.Semaphore(cfg.concurrency)

    async def run(self) -> Tally:
        import aiohttp

        cfg, t = self.cfg, self.t
        storm_at = {int(cfg.requests * (k + 1) / (cfg.storms + 1)) for k in range(cfg.storms)}
        kill_at = int(cfg.requests * 0.4) if cfg.kill_prefill and cfg.prefill > 0 else -1
        conn = aiohttp.TCPConnector(limit=cfg.concurrency + cfg.storm_size + 8)
        async with aiohttp.ClientSession(connector=conn,
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            tasks = []
            for i in range(cfg.requests):
                if i in storm_at:
                    tasks.append(asyncio.ensure_future(self.storm(http)))
                if i == kill_at:
                    tasks.append(asyncio.ensure_future(self.kill()))
                await self.sem.acquire()          # released by the request when it ends
                tasks.append(asyncio.ensure_future(self.paced(i, http)))
                t.sent += 1
                if (i + 1) % 500 == 0:
                    log(f"{i + 1}/{cfg.requests} sent: {t.completed} completed, "
                        f"{t.cancelled} cancelled, {t.errors} errors, "
                        f"{t.mismatches} mismatches")
            await asyncio.gather(*tasks)
        return t

    async def request(self, i: int, http, cancel_after: float | None) -> None:
        t = self.t
        k = i % len(self.pool) if i < 0 else self.rng.randrange(len(self.pool))
        prompt, params = self.pool[k]
        task = asyncio.ensure_future(one(http, self.c.url, prompt, params, stream=i % 2 == 0))
        try:
            got = await (asyncio.wait_for(task, cancel_after) if cancel_after is not None
                         else task)
        except asyncio.TimeoutError:
            t.cancelled += 1
            return
        except Exception as e:  # noqa: BLE001 - counted, a few shown
            t.errors += 1
            if len(t.error_samples) < 5:
                t.error_samples.append(repr(e)[:300])
            return
        t.completed += 1
        if got != self.want[k]:
            t.mismatches += 1
            if len(t.mismatch_samples) < 5:
                t.mismatch_samples.append({"pool_index": k, "got": got, "want": self.want[k]})

    async def paced(self, i: int, http) -> None:
        try:
            rng = self.rng
            cancel = abort_delay(rng) if rng.random() < self.cfg.abort_rate else None
            await self.request(i, http, cancel)
        finally:
            self.sem.release()

    async def storm(self, http) -> None:
        """storm_size requests at once, every one cancelled at the same moment."""
        delay = self.rng.uniform(0.02, 0.3)
        self.t.storm_requests += self.cfg.storm_size
        await asyncio.gather(*(self.request(-1 - j, http, delay)
                               for j in range(self.cfg.storm_size)))

    async def kill(self) -> None:
        """SIGKILL a prefill in the middle of a transfer, then restart it."""
        c = self.c
        name = f"prefill-{self.cfg.prefill - 1}"
        busy = await wait_writing(c.nats_url, c.procs[name].instance_id, within_s=10.0)
        log(f"SIGKILL {name} ({busy} KV writes in flight)")
        c.kill(name)
        await asyncio.sleep(1.0)
        await c.arestart(name)
        log(f"{name} restarted")


async def wait_writing(nats_url: str, instance_id: str, within_s: float) -> int:
    """Until the prefill instance has KV writes in flight (or within_s passed); how many."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        deadline = time.monotonic() + within_s
        while True:
            for i in await micro.stats(nc, "prefill", wait_s=0.05):
                n = i.stats.get("kv_writes_in_flight", 0)
                if i.instance_id == instance_id and n > 0:
                    return n
            if time.monotonic() > deadline:
                return 0
    finally:
        await nc.close()


# ---- afterwards --------------------------------------------------------------------------
async def decode_stats(nats_url: str) -> dict:
    import nats

    nc = await nats.connect(nats_url)
    try:
        return {svc: await micro.service_stats(nc, svc) for svc in ("decode", "prefill")}
    finally:
        await nc.close()


async def quiesce(cfg: ChaosConfig, nats_url: str) -> dict:
    """Until decode holds no request, no quarantined block and no used block (or timeout)."""
    deadline = time.monotonic() + cfg.quiesce_s + cfg.lease_s
    while True:
        st = await decode_stats(nats_url)
        d = st["decode"]
        total = micro.sum_stats(d)
        busy = sum(total.get(k, 0) for k in ("requests", "requests_live", "awaiting_kv",
                                              "blocks_used", "blocks_quarantined",
                                              "requests_quarantined"))
        if (d and busy == 0) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.5)


async def healthy(c) -> list[str]:
    """Problems: gateway /health, an instance missing from $SRV.PING, a child that died."""
    import aiohttp

    problems = [f"{p.name} exited ({p.returncode})" for p in c.unexpected_exits()]
    async with aiohttp.ClientSession() as http:
        async with http.get(c.url + "/health") as r:
            if r.status != 200:
                problems.append(f"gateway /health {r.status}: {await r.text()}")
    nc = await micro.connect_once(c.nats_url)
    try:
        seen = {(i.service, i.instance_id) for i in await micro.ping(nc)}
    finally:
        await nc.close()
    for p in c.procs.values():
        if p.service != "nats" and (p.service, p.instance_id) not in seen:
            problems.append(f"{p.name} does not answer $SRV.PING")
    return problems


def merge_counts(stats: list[dict], key: str) -> dict:
    out: dict[str, int] = {}
    for s in stats:
        for k, v in (s.get(key) or {}).items():
            out[k] = out.get(k, 0) + v
    return out


async def arun(cfg: ChaosConfig) -> dict:
    t0 = time.monotonic()
    pool = request_pool(cfg.model, cfg)
    want = references(cfg.model, pool)
    log(f"{len(pool)} references in {time.monotonic() - t0:.1f}s; starting the mesh")
    c = cluster(cfg)
    await c.astart()
    try:
        t1 = time.monotonic()
        tally = await load(cfg, c, pool, want)
        load_s = time.monotonic() - t1
        st = await quiesce(cfg, c.nats_url)
        problems = await healthy(c)
    finally:
        await c.astop()
    d, p = st["decode"], st["prefill"]
    dt, pt = micro.sum_stats(d), micro.sum_stats(p)
    lat = d[0].get("reclaim_latency_ms", {}) if d else {}
    res = {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("log_dir", "echo")},
        "requests": tally.sent + tally.storm_requests, "completed": tally.completed,
        "client_cancelled": tally.cancelled, "errors": tally.errors,
        "mismatches": tally.mismatches,
        "aborts": dt.get("aborts", 0), "aborts_by_reason": merge_counts(d, "aborts_by_reason"),
        "reclaims": dt.get("reclaims", 0),
        "reclaims_by_outcome": merge_counts(d, "reclaims_by_outcome"),
        "kv_writes_fenced": dt.get("kv_writes_fenced", 0),
        "kv_writes_applied": dt.get("kv_writes_applied", 0),
        "kv_writes_stray": dt.get("kv_writes_stray", 0),
        "claims_refused": dt.get("claims_refused", 0),
        "pd": dt.get("pd", 0), "colocated": dt.get("colocated", 0),
        "prefill_fallbacks": dt.get("prefill_fallbacks", 0),
        "prefill_jobs_reclaimed": pt.get("jobs_reclaimed", 0),
        "prefill_jobs_refused": pt.get("jobs_refused", 0),
        "prefill_jobs_redelivered": pt.get("jobs_redelivered", 0),
        "blocks_leaked": dt.get("blocks_used", 0) + dt.get("blocks_quarantined", 0),
        "blocks_quarantined_after": dt.get("blocks_quarantined", 0),
        "requests_left": dt.get("requests", 0) + dt.get("requests_live", 0),
        "reclaim_latency_ms": lat,
        "reclaim_latency_buckets": d[0].get("reclaim_latency_buckets", {}) if d else {},
        "unhealthy": problems,
        "error_samples": tally.error_samples, "mismatch_samples": tally.mismatch_samples,
        "load_s": round(load_s, 1), "wall_s": round(time.monotonic() - t0, 1),
    }
    return res


def run(cfg: ChaosConfig) -> dict:
    return asyncio.run(arun(cfg))


def headline(res: dict) -> str:
    lat = res["reclaim_latency_ms"]
    return (f"requests={res['requests']} completed={res['completed']} "
            f"cancelled={res['client_cancelled']} errors={res['errors']} "
            f"aborts={res['aborts']} reclaims={res['reclaims']} {res['reclaims_by_outcome']} "
            f"fenced={res['kv_writes_fenced']} mismatches={res['mismatches']} "
            f"leaked={res['blocks_leaked']} reclaim_ms p50={lat.get('p50')} "
            f"p99={lat.get('p99')} max={lat.get('max')} load={res['load_s']}s "
            f"wall={res['wall_s']}s unhealthy={res['unhealthy']}")
