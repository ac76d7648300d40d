"""Load under faults: concurrent greedy streams against a gateway, what each request got and
when, and how it compares with the engine alone (scripts/faults_bench.py and the e2e fault
tests of `pdmesh up` drive it).

A request fails when it gets an HTTP error, an error event or a lost connection; it is wrong
when it completes with tokens other than its reference's.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp


class Load:
    """Streams of greedy completions; what each request got, and when."""

    def __init__(self, url: str, prompts: list[list[int]], model: str, max_tokens: int = 64,
                 api_key: str = ""):
        self.url, self.prompts, self.model, self.max_tokens = url, prompts, model, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.results: list[dict] = []
        self.streaming: dict[int, int] = {}    # request -> tokens so far (live ones)

    async def one(self, http, i: int) -> None:
        body = {"model": self.model, "prompt": self.prompts[i % len(self.prompts)],
                "stream": True, "return_token_ids": True, "temperature": 0.0,
                "max_tokens": self.max_tokens, "ignore_eos": True}
        r = {"i": i, "tokens": [], "error": None, "status": 0, "max_stall_s": 0.0,
             "t0": time.monotonic()}
        last = r["t0"]
        try:
            async with http.post(self.url + "/v1/completions", json=body,
                                 headers=self.headers) as resp:
                r["status"] = resp.status
                if resp.status != 200:
                    r["error"] = (await resp.json())["error"]
                else:
                    await self._read(resp, r, i, last)
        except Exception as e:  # noqa: BLE001 - a lost connection is a failure
            r["error"] = {"message": repr(e)}
        self.streaming.pop(i, None)
        r["latency_s"] = time.monotonic() - r["t0"]
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

    async def run(self, n: int, concurrency: int = 16,
                  until: asyncio.Future | None = None) -> None:
        """n requests, `concurrency` at a time; with `until`, more after the n while it is
        not done (a fault that must meet requests in flight however long it takes)."""
        todo = itertools.count()

        async def worker(http):
            while (i := next(todo)) < n or (until is not None and not until.done()):
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

    def failed(self) -> list[dict]:
        return [r for r in self.results if r["error"] is not None]

    def wrong(self, refs: list[list[int]]) -> list[int]:
        """Requests that completed with other tokens than their reference."""
        return [r["i"] for r in self.results if r["error"] is None
                and r["tokens"] != refs[r["i"] % len(refs)]]


async def metrics_text(url: str, api_key: str = "") -> str:
    """The gateway's /metrics page."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics", headers=headers) as r:
            return await r.text()


def sample(text: str, name: str) -> float:
    """The sum of the samples whose line starts with name ('pdmesh_x_total' or one series,
    'pdmesh_x_total{reason="y"}') on a /metrics page; 0 when there is none."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def metric(url: str, name: str, api_key: str = "") -> float:
    """The sum of a Prometheus metric's samples on the gateway's /metrics."""
    return sample(await metrics_text(url, api_key), name)


def references(engine_config, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the engine alone (what an undisturbed mesh answers in
    deterministic mode)."""
    from shared.contracts.sampling import SamplingParams
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(engine_config)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o["token_ids"] for o in eng.generate(prompts, sp)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0
