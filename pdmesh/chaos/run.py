"""Chaos run for invariant 3 (no KV slot is reused while a write to it can still land).

A real mesh (deterministic mode, tiny model): decode with a small KV pool so freed blocks
are handed out again at once, prefill with random delays on every KV write (so writes are
still on the wire when aborts come) and small KV messages (several writes per job). Load
over HTTP from a fixed pool of distinct (prompt, params) requests, many cancelled by the
client at a random moment (right after submit too), abort storms (a burst of requests all
cancelled at once), and one prefill SIGKILLed mid-run and restarted. Every request that
completes must equal its reference (the engine alone) token for token; afterwards decode
must be quiescent with no block used or quarantined, and every service healthy.

    run(ChaosConfig(model=..., requests=1000)) -> dict of the numbers (chaos_report.py)
    python scripts/chaos.py --requests 30000 [--no-reclaim-ack] [--no-epoch-fence] [--guards all]

Invariant 3 has two independent guards; each can be switched off (TEST ONLY decode
settings, allowed by PDMESH_ALLOW_FAULTS=1, which the mesh here is given):
    reclaim_ack=False  every claim granted, aborted blocks freed at once
    epoch_fence=False  every KV write lands where it points
GUARDS names the four combinations: "both", "fence_only", "ack_only", "none". With one
guard the run must still give no mismatch (and show the hazard the other guard covers was
hit: kv_writes_fenced, kv_writes_quarantined); with none it must show mismatches.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from pdmesh.bench.run import PROMPTS as BENCH_PROMPTS
from pdmesh.chaos.mesh import DET, SHAPES, cluster, healthy, quiesce, wait_writing
from pdmesh.chaos.report import Tally, headline, partial, point, result
from shared import micro

__all__ = ["GUARDS", "HAZARD", "ONE_WRITE", "ChaosConfig", "Tally", "arun", "hazard", "headline",
           "run", "with_guards"]

PROMPTS = [*BENCH_PROMPTS, "The capital of France is"]     # pdmesh bench's, and one
# name -> (reclaim_ack, epoch_fence)
GUARDS = {"both": (True, True), "fence_only": (False, True), "ack_only": (True, False),
          "none": (False, False)}


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
    kv_stream: bool = True           # layer-wise writes; False: the default whole-prompt path
    #                                  (a first delivery's claim goes out during its compute;
    #                                  a prompt's KV in one write carries its PrefillDone)
    kv_window: int = 2
    reclaim_ack: bool = True
    epoch_fence: bool = True
    lease_s: float = 3.0
    quiesce_s: float = 30.0
    seed: int = 0
    min_completed: int = 0           # send on past `requests` until this many completed
    sample_s: float = 5.0            # decode STATS sampled this often (the timeline)
    log_every: int = 500             # progress line every this many requests sent
    log_dir: str | None = None
    echo: bool = False

    @property
    def guards(self) -> str:
        return next(k for k, v in GUARDS.items() if v == (self.reclaim_ack, self.epoch_fence))


# The negative controls (tests/e2e/test_chaos_controls.py, scripts/chaos.py --hazard): a
# short run made hazardous enough that with no guard corruption shows every time (at 300
# requests, 7 to 17 of ~150 compared requests differed over four runs; the rate grows as
# corrupted blocks enter the prefix cache, so 400): one prefill whose KV writes wait up
# to 0.4 s each, half the requests cancelled, the pool of the full run. No prefill is
# killed and the lease is long, so with the ack on every reclaim is acked (none by lease).
HAZARD = dict(requests=400, prefill=1, kill_prefill=False, storms=2, storm_size=16,
              abort_rate=0.5, write_delay_s=0.4, lease_s=10.0, sample_s=2.0, log_every=100)


# The default whole-prompt KV path (tests/e2e/test_chaos*.py, scripts/chaos.py --no-kv-stream):
# no layer-wise writes, a prompt's KV in one write (which carries its PrefillDone), the claim
# sent while the prompt computes.
ONE_WRITE = dict(kv_stream=False, kv_max_write_bytes=8 << 20)


def hazard(model: str, guards: str, **kw) -> ChaosConfig:
    """The negative-control run with the guards named (a GUARDS key)."""
    return with_guards(ChaosConfig(model=model, **(HAZARD | kw)), guards)


def with_guards(cfg: ChaosConfig, guards: str) -> ChaosConfig:
    """cfg with the guards named (a GUARDS key) and nothing else changed."""
    ack, fence = GUARDS[guards]
    return replace(cfg, reclaim_ack=ack, epoch_fence=fence)


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


_REFERENCES: dict[str, list[list[int]]] = {}     # the same pool in one process: computed once


def references(model: str, pool) -> list[list[int]]:
    """Each pool entry's output from the engine alone, configured like the mesh's decode."""
    key = json.dumps([model, pool])
    if key not in _REFERENCES:
        from shared.contracts.sampling import SamplingParams
        from shared.engine.config import EngineConfig
        from shared.engine.engine import LLMEngine

        eng = LLMEngine(EngineConfig(model=model, num_blocks=512, max_num_seqs=16, **DET,
                                     **SHAPES))
        outs = eng.generate([p for p, _ in pool], [SamplingParams(**kw) for _, kw in pool])
        _REFERENCES[key] = [o["token_ids"] for o in outs]
    return _REFERENCES[key]


# ---- the load -----------------------------------------------------------------------------
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


class _Load:
    """Requests from the pool at cfg.concurrency (a share of them cancelled by the client),
    abort storms spread over the run, and one prefill SIGKILLed mid-transfer; decode's
    STATS sampled every cfg.sample_s meanwhile (the timeline)."""

    def __init__(self, cfg: ChaosConfig, c, pool, want, on_sample=None):
        self.cfg, self.c, self.pool, self.want = cfg, c, pool, want
        self.on_sample = on_sample
        self.rng = random.Random(cfg.seed + 1)
        self.t = Tally()
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.timeline: list[dict] = []
        self.events: list[dict] = []          # storms, the kill and restart, when
        self.t0 = time.monotonic()

    async def run(self) -> Tally:
        import aiohttp

        cfg = self.cfg
        conn = aiohttp.TCPConnector(limit=cfg.concurrency + cfg.storm_size + 8)
        sampler = asyncio.ensure_future(self.sample_every(cfg.sample_s))
        self.t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession(connector=conn,
                                             timeout=aiohttp.ClientTimeout(total=120)) as http:
                await asyncio.gather(*await self.send(http))
        finally:
            sampler.cancel()
        await self.sample()                           # the last point: load done
        return self.t

    async def send(self, http) -> list[asyncio.Future]:
        """cfg.requests requests (more while fewer than cfg.min_completed completed), the
        storms and the kill among them; their tasks."""
        cfg, t = self.cfg, self.t
        storm_at = {int(cfg.requests * (k + 1) / (cfg.storms + 1)) for k in range(cfg.storms)}
        kill_at = int(cfg.requests * 0.4) if cfg.kill_prefill and cfg.prefill > 0 else -1
        tasks, i, most = [], 0, 3 * max(cfg.requests, cfg.min_completed)   # most: a broken mesh
        while i < cfg.requests or (t.completed < cfg.min_completed and i < most):
            if i in storm_at:
                tasks.append(asyncio.ensure_future(self.storm(http)))
            if i == kill_at:
                tasks.append(asyncio.ensure_future(self.kill()))
            await self.sem.acquire()          # released by the request when it ends
            tasks.append(asyncio.ensure_future(self.paced(i, http)))
            t.sent += 1
            i += 1
            if i % cfg.log_every == 0:
                self.progress()
            if len(tasks) > 4 * cfg.concurrency:
                tasks = [x for x in tasks if not x.done() or x.cancelled() or x.exception()]
        return tasks

    def event(self, what: str) -> None:
        self.events.append({"t_s": round(time.monotonic() - self.t0, 2), "event": what})
        log(what)

    def progress(self) -> None:
        t, n = self.t, self.cfg.requests
        el = time.monotonic() - self.t0
        rate = t.sent / el if el > 0 else 0.0
        eta = (n - t.sent) / rate if rate else 0.0
        log(f"{t.sent}/{n} sent ({rate:.1f}/s, ETA {eta / 60:.1f} min): {t.completed} "
            f"completed, {t.cancelled} cancelled, {t.errors} errors, {t.mismatches} mismatches")

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
        self.event(f"storm of {self.cfg.storm_size}, cancelled after {delay * 1e3:.0f} ms")
        await asyncio.gather(*(self.request(-1 - j, http, delay)
                               for j in range(self.cfg.storm_size)))

    async def kill(self) -> None:
        """SIGKILL a prefill in the middle of a transfer, then restart it."""
        c = self.c
        name = f"prefill-{self.cfg.prefill - 1}"
        busy = await wait_writing(c.nats_url, c.procs[name].instance_id, within_s=10.0)
        self.event(f"SIGKILL {name} ({busy} KV writes in flight)")
        c.kill(name)
        await asyncio.sleep(1.0)
        await c.arestart(name)
        self.event(f"{name} restarted")

    async def sample_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.sample()

    async def sample(self) -> None:
        try:
            await self._sample()
        except Exception as e:  # noqa: BLE001 - a missed sample is not a failed run
            log(f"STATS sample failed: {e!r}")

    async def _sample(self) -> None:
        """One timeline point: the client's tally and decode's counters now."""
        d = await micro.service_stats(self.c.nats_url, "decode", expect=1)
        el = time.monotonic() - self.t0
        self.timeline.append(point(el, self.t, d[0] if d else {}))
        if self.on_sample is not None:
            self.on_sample(partial(self.cfg_dict(), self.t, self.timeline, el))

    def cfg_dict(self) -> dict:
        return {k: v for k, v in asdict(self.cfg).items() if k not in ("log_dir", "echo")}


async def arun(cfg: ChaosConfig, on_sample: Callable[[dict], None] | None = None) -> dict:
    """The run; on_sample(partial result) after each timeline point (scripts/chaos.py
    writes it to disk, so an interrupted run still leaves numbers)."""
    t0 = time.monotonic()
    pool = request_pool(cfg.model, cfg)
    want = references(cfg.model, pool)
    log(f"guards {cfg.guards}: {len(pool)} references in {time.monotonic() - t0:.1f}s; "
        f"starting the mesh")
    c = cluster(cfg)
    await c.astart()
    try:
        ld = _Load(cfg, c, pool, want, on_sample)
        t1 = time.monotonic()
        tally = await ld.run()
        load_s = time.monotonic() - t1
        st = await quiesce(cfg, c.nats_url)
        problems = await healthy(c)
    finally:
        await c.astop()
    return result(ld.cfg_dict(), tally, st, problems, ld.timeline, ld.events, load_s,
                  time.monotonic() - t0)


def run(cfg: ChaosConfig, on_sample: Callable[[dict], None] | None = None) -> dict:
    return asyncio.run(arun(cfg, on_sample))
