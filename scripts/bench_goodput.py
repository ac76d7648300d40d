"""Goodput on mixed traffic: the highest Poisson request rate a server sustains while its
requests meet a latency target, pdmesh (PD, and colocated) against llama-server on the
same host, the same requests in the same order at the same arrival times.

  workload  chat turns (a system line and a question, 40-300 prompt tokens, 64 output
            tokens) and, one request in --long-share, a long prompt (a coding agent's
            context: 2,000-4,000 tokens of Python source, 32 output tokens), greedy,
            ignore_eos; fresh requests at each rate (seeded by the rate's index: no prefix
            cache carries a prompt from one rate to the next), the same for every server;
            text prompts (each server tokenizes them itself)
  arrivals  Poisson at each --rates value, --requests per rate
  target    a request meets it when its TTFT <= --ttft-slo (1 s) and its mean gap between
            tokens <= --itl-slo (100 ms); goodput is the highest rate at which at least
            --attainment (90%) of requests meet it (DistServe's definition); p99 TTFT and
            p99 ITL over all requests are reported beside it
  servers   `pdmesh up` at its defaults (PD: one prefill, one decode), `pdmesh up --mode
            colocated`, `pdmesh up` with prompts under --pd-from tokens prefilled on decode
            (decode.min_pd_prompt_tokens), `pdmesh up` without decode's batch helper thread
            (the A/B of what it costs prefill), and llama-server (-t 2 -np 8 -c 65536: 8,192 tokens per slot) on
            the bundled GGUF when --llama-server names its binary

    python scripts/bench_goodput.py [--llama-server PATH] [--rates 0.5 1 2 4]

Writes docs/bench/goodput.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdmesh.bench.http import start, stop, timed_stream
from pdmesh.bench.report import save

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the tides", "binary search", "photosynthesis", "the French revolution",
          "TCP congestion control", "a sourdough starter", "black holes", "the Rust borrow "
          "checker", "compound interest", "plate tectonics", "the immune system", "jazz harmony"]


def log(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(tok, n: int, long_share: float, seed: int = 0) -> list[dict]:
    """n requests: (prompt text, max_tokens, kind); the same every run."""
    import argparse as m1
    import asyncio.base_events as m2
    import json.decoder as m3
    import logging as m4
    source = "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4))
    ids = tok.encode(source)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < long_share:
            length = rng.randint(2000, 4000)
            start = rng.randrange(0, len(ids) - length)
            text = tok.decode(ids[start:start + length]) + "\n# Explain what this does:\n"
            out.append({"kind": "long", "prompt": text, "max_tokens": 32})
        else:
            topic = rng.choice(TOPICS)
            extra = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 40)))
            text = (f"You are a helpful assistant. Related topics: {extra}.\n"
                    f"Question: explain {topic} in a few sentences.\nAnswer:")
            out.append({"kind": "chat", "prompt": text, "max_tokens": 64})
    return out


async def one(http, url: str, model: str, req: dict) -> dict:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True}
    try:
        return {"kind": req["kind"]} | await timed_stream(http, url, body)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"kind": req["kind"], "ttft_s": None, "gaps_s": [], "error": repr(e)}


async def run_rate(url: str, model: str, reqs: list[dict], rate: float, seed: int) -> list:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(600)) as http:
        tasks = []
        for req in reqs:
            tasks.append(asyncio.ensure_future(one(http, url, model, req)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def judge(results: list[dict], ttft_slo: float, itl_slo: float) -> dict:
    ok = [r for r in results if r.get("ttft_s") is not None and not r.get("error")]

    def meets(r):
        mean_gap = sum(r["gaps_s"]) / len(r["gaps_s"]) if r["gaps_s"] else 0.0
        return r["ttft_s"] <= ttft_slo and mean_gap <= itl_slo
    by_kind = {k: [r for r in ok if r["kind"] == k] for k in ("chat", "long")}
    return {"requests": len(results), "errors": len(results) - len(ok),
            "attainment": sum(meets(r) for r in ok) / len(results),
            "ttft_p50_s": pct([r["ttft_s"] for r in ok], 50),
            "ttft_p99_s": pct([r["ttft_s"] for r in ok], 99),
            "itl_p99_s": pct([g for r in ok for g in r["gaps_s"]], 99),
            **{f"{k}_ttft_p50_s": pct([r["ttft_s"] for r in v], 50)
               for k, v in by_kind.items()},
            **{f"{k}_attainment": (sum(meets(r) for r in v) / len(v) if v else None)
               for k, v in by_kind.items()}}


def servers(args) -> list[tuple[str, list[str], str | None, str]]:
    """(name, argv, its URL (None: pdmesh up's, from its log), model name)."""
    up = [sys.executable, "-m", "pdmesh", "up", "--port", "0"]
    out = [("pdmesh PD", up, None, "SmolLM2-135M-Instruct"),
           ("pdmesh colocated", up + ["--mode", "colocated"], None, "SmolLM2-135M-Instruct"),
           (f"pdmesh PD from {args.pd_from} tokens",
            up + ["--set", f"decode.min_pd_prompt_tokens={args.pd_from}"], None,
            "SmolLM2-135M-Instruct"),
           ("pdmesh PD, no batch helper", up + ["--set", "decode.batch_helper=false"], None,
            "SmolLM2-135M-Instruct")]
    if args.llama_server:
        from shared.engine.gguf_convert import find_gguf
        out.append(("llama-server", [args.llama_server, "-m", str(find_gguf()), "--port",
                                     "8091", "-np", "8", "-c", "65536", "-t", "2"],
                    "http://127.0.0.1:8091", "smollm2"))
    return [x for x in out if not args.servers or x[0] in args.servers]


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, by_rate in res["servers"].items():
        rates = [float(r) for r in by_rate]
        s = list(by_rate.values())
        ax[0].plot(rates, [x["attainment"] * 100 for x in s], "o-",
                   label=f"{name}: goodput {res['goodput'][name]} req/s")
        ax[1].plot(rates, [(x["ttft_p99_s"] or 0) for x in s], "o-", label=name)
        ax[2].plot(rates, [(x["itl_p99_s"] or 0) * 1e3 for x in s], "o-", label=name)
    ax[0].axhline(res["attainment_target"] * 100, ls="--", c="k", lw=1)
    ax[1].axhline(res["ttft_slo_s"], ls="--", c="k", lw=1)
    ax[2].axhline(res["itl_slo_s"] * 1e3, ls="--", c="k", lw=1)
    for a, y in zip(ax, ("% requests within TTFT and ITL targets", "p99 TTFT (s)",
                         "p99 gap between tokens (ms)")):
        a.set_xlabel("request rate (req/s, Poisson)")
        a.set_ylabel(y)
        a.set_xscale("log", base=2)
        a.legend(fontsize=8)
    fig.suptitle(f"mixed traffic ({res['long_share']:.0%} long prompts), "
                 f"{res['requests_per_rate']} requests per rate, one run")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4])
    ap.add_argument("--requests", type=int, default=30, help="per rate")
    ap.add_argument("--long-share", type=float, default=0.1)
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--itl-slo", type=float, default=0.1)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--pd-from", type=int, default=1000,
                    help="the third pdmesh: prompts shorter than this prefilled on decode")
    ap.add_argument("--servers", nargs="*", default=[],
                    help="only these (by name); the others' results already in the JSON stay")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    from shared.engine.gguf_convert import convert, default_model_dir
    from shared.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(str(convert(default_model_dir()))).hf
    work = [workload(tok, a.requests, a.long_share, seed=i + 1) for i in range(len(a.rates))]
    log(f"{a.requests} requests per rate, long: {[sum(r['kind'] == 'long' for r in w) for w in work]}; "
        f"rates {a.rates}")
    res = {"rates": a.rates, "requests_per_rate": a.requests, "long_share": a.long_share,
           "ttft_slo_s": a.ttft_slo, "itl_slo_s": a.itl_slo, "attainment_target": a.attainment,
           "cpu_count": os.cpu_count(), "servers": {}, "goodput": {}}
    old = Path(a.out) / "goodput.json"
    if a.servers and old.is_file():
        kept = json.loads(old.read_text())
        res["servers"], res["goodput"] = kept["servers"], kept["goodput"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv, url, model in servers(a):
            log(f"{name}: {' '.join(argv[:6])} ...")
            proc, url = start(argv, Path(tmp) / "server.log", url)
            try:
                warm = workload(tok, 2, 0.5, seed=0)
                asyncio.run(run_rate(url, model, warm, 10.0, 0))
                res["servers"][name] = {}
                for i, rate in enumerate(a.rates):
                    got = judge(asyncio.run(run_rate(url, model, work[i], rate, seed=i)),
                                a.ttft_slo, a.itl_slo)
                    res["servers"][name][str(rate)] = got
                    log(f"  {name} {rate} req/s: attainment {got['attainment']:.0%}, TTFT "
                        f"p99 {got['ttft_p99_s']:.2f} s, ITL p99 "
                        f"{(got['itl_p99_s'] or 0) * 1e3:.0f} ms, errors {got['errors']}")
            finally:
                stop(proc)
            met = [float(r) for r, s in res["servers"][name].items()
                   if s["attainment"] >= a.attainment]
            res["goodput"][name] = max(met) if met else 0.0
            log(f"{name}: goodput {res['goodput'][name]} req/s")
    path = save(res, a.out, "goodput", plot)
    log(f"goodput {res['goodput']}; wrote {path}.json and .png")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
