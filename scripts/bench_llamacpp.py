"""pdmesh against what a user would run instead: llama.cpp on the same SmolLM2 GGUF.

One load generator, the same chat prompts, concurrency 1 / 4 / 16, greedy, 64 output
tokens, streamed /v1/chat/completions (OpenAI-compatible on all three servers):

  llama-server         built from the llama.cpp source vendored in llama-cpp-python's sdist
                       (cmake --build build --target llama-server), `-np 16 -c 16384 -t 2`;
                       natively (-DGGML_NATIVE=ON) where the CPU grants what it lists;
                       where it lists AMX but the VM does not grant it (SIGILL in
                       tinygemm_kernel_amx at the first request), add -mno-amx-tile
                       -mno-amx-int8 -mno-amx-bf16 to CMAKE_C(XX)_FLAGS. A non-native
                       build must not turn on what the CPU lacks (GGML_AVX_VNNI=ON on an
                       EPYC with AVX512-VNNI but no AVX-VNNI: SIGILL at the first forward)
  llama-cpp-python     `python -m llama_cpp.server --interrupt_requests False` (one request
                       at a time; without the flag a new request cuts the running one short)
  pdmesh               as `make run` starts it (--pdmesh-url of a running mesh, or
                       --spawn-pdmesh: pdmesh up --model <converted folder> with the flags
                       `make run` passes)

All servers run at once (idle while another is measured) and take turns: per round, per
level, each server runs the level, so that a machine's drift (a shared VM's neighbours:
the same level measured 2x apart minutes later here) lands on every server alike. Per
server and level: output tokens/s (completion tokens / wall time), TTFT and ITL
percentiles, each the median over --rounds; the ratio is the median of the rounds'
ratios (each round's runs minutes apart at most). The llama.cpp builds stay out of `make test`; this script only talks HTTP to
the servers (it starts them when given their binaries). Writes <out>/llamacpp.json, .png.

    python scripts/bench_llamacpp.py --llama-server PATH/llama-server \
        [--llama-cpp-python PATH/python] [--pdmesh-url URL | --spawn-pdmesh] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdmesh.bench.http import wait_http
from pdmesh.bench.loadgen import percentile
from pdmesh.bench.report import save

ROOT = Path(__file__).resolve().parents[1]


PROMPTS = [
    "Explain how a hash table works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of climate change?", "Describe the water cycle in detail.",
    "How do I write a for loop in Python? Give examples.", "Summarize the French Revolution.",
    "What is the difference between a list and a tuple?", "Give me ten tips for better sleep.",
    "Explain photosynthesis to a ten year old.", "Write a poem about the ocean at night.",
    "How does a car engine work?", "What is machine learning? Explain with examples.",
    "Describe your ideal weekend.", "What are the benefits of regular exercise?",
    "Explain the rules of chess briefly.", "How do vaccines work?",
]
LEVELS = {1: 8, 4: 16, 16: 32}     # concurrency -> requests
MAKE_RUN_FLAGS: list[str] = []   # make run is `pdmesh up` at its defaults (the fast ones)


def log(msg: str) -> None:
    print(f"[llamacpp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def one(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage = [], None
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            ev = json.loads(line[5:])
            usage = ev.get("usage") or usage
            ch = (ev.get("choices") or [{}])[0].get("delta") or {}
            if ch.get("content"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or len(times)
    itl = [(b - a) for a, b in zip(times, times[1:])]
    if times and n > len(times):       # several tokens per chunk
        itl = [x * (len(times) - 1) / (n - 1) for x in itl]
    return {"ttft_s": (times[0] - t0) if times else None, "itl_s": itl, "tokens": n,
            "latency_s": end - t0}


async def level(url: str, model: str, c: int, n: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(c)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
        await one(http, url, model, "Hello!", 8)                  # warm-up

        async def run(i):
            async with sem:
                return await one(http, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)

        t = time.perf_counter()
        rs = await asyncio.gather(*(run(i) for i in range(n)))
        wall = time.perf_counter() - t
    ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    itl = [x for r in rs for x in r["itl_s"]]
    tokens = sum(r["tokens"] for r in rs)
    return {"requests": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90)}



def start(argv: list[str], url: str, log_path: Path, ready: str) -> subprocess.Popen:
    log(" ".join(argv))
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(log_path, "w"),
                         stderr=subprocess.STDOUT)
    wait_http(url, ready)
    return p


def servers(args) -> list[tuple[str, list[str] | None, str, str]]:
    """(name, argv to start it or None, url, model name)."""
    gguf = args.gguf
    out = []
    if args.llama_server:
        out.append(("llama-server", [args.llama_server, "-m", gguf, "--port", "8081",
                                     "-np", "16", "-c", "16384", "-t", str(args.threads)],
                    "http://127.0.0.1:8081", "smollm2"))
    if args.llama_cpp_python:
        out.append(("llama-cpp-python", [args.llama_cpp_python, "-m", "llama_cpp.server",
                                         "--model", gguf, "--port", "8082",
                                         "--n_threads", str(args.threads),
                                         "--interrupt_requests", "False"],
                    "http://127.0.0.1:8082", "smollm2"))
    if args.spawn_pdmesh:
        out.append(("pdmesh", [sys.executable, "-m", "pdmesh.cli", "up", "--model",
                               args.pdmesh_model, "--port", "8083", *args.pdmesh_flags.split()],
                    "http://127.0.0.1:8083", Path(args.pdmesh_model).name))
    elif args.pdmesh_url:
        out.append(("pdmesh", None, args.pdmesh_url.rstrip("/"), Path(args.pdmesh_model).name))
    return out


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["servers"])
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for j, n in enumerate(names):
        lv = res["servers"][n]
        xs = [i + (j - (len(names) - 1) / 2) * 0.8 / len(names) for i in range(len(lv))]
        b = ax[0].bar(xs, [lv[c]["tokens_per_s"] for c in lv], 0.8 / len(names), label=n)
        ax[0].bar_label(b, [f"{lv[c]['tokens_per_s']:.0f}" for c in lv], fontsize=7)
        ax[1].bar(xs, [(lv[c]["itl_p50_s"] or 0) * 1e3 for c in lv], 0.8 / len(names), label=n)
    for a, y in zip(ax, ("output tokens/s", "ITL p50 (ms)")):
        a.set_xticks(range(len(LEVELS)), [f"c={c}" for c in LEVELS])
        a.set_ylabel(y)
        a.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct: pdmesh vs llama.cpp (greedy, 64 tokens, same prompts)")
    fig.tight_layout()
    fig.savefig(out)


def main() -> int:
    from shared.engine.gguf_convert import default_model_dir, find_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--llama-cpp-python", default="", help="python with llama_cpp[server]")
    ap.add_argument("--pdmesh-url", default="")
    ap.add_argument("--spawn-pdmesh", action="store_true")
    ap.add_argument("--pdmesh-model", default=str(default_model_dir()))
    ap.add_argument("--pdmesh-flags", default=" ".join(MAKE_RUN_FLAGS),
                    help="pdmesh up's flags with --spawn-pdmesh (default: none, as make run)")
    ap.add_argument("--gguf", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    args.gguf = args.gguf or str(find_gguf())
    res = {"gguf": os.path.basename(args.gguf), "max_tokens": args.max_tokens,
           "levels": LEVELS, "cpus": os.cpu_count(), "servers": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs, live = [], []
    try:
        for name, argv, url, model in servers(args):
            ready = "/ready" if name == "pdmesh" else "/v1/models"   # pdmesh: every service up
            if argv:
                procs.append(start(argv, url, out / f"llamacpp_{name}.log", ready))
            live.append((name, url, model))
        runs = {name: {c: [] for c in LEVELS} for name, _, _ in live}
        for r in range(args.rounds):
            for c, n in LEVELS.items():
                for name, url, model in live:
                    got = asyncio.run(level(url, model, c, n, args.max_tokens))
                    runs[name][c].append(got)
                    log(f"round {r + 1}/{args.rounds} {name} c={c}: {got['tokens_per_s']:.1f} "
                        f"tok/s, TTFT p50 {got['ttft_p50_s'] * 1e3:.0f} ms, ITL p50 "
                        f"{got['itl_p50_s'] * 1e3:.1f} ms")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    res["rounds"] = args.rounds
    res["runs"] = runs
    res["servers"] = {name: {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                             for c, rs in lv.items()} for name, lv in runs.items()}
    for name, lv in res["servers"].items():
        for c, m in lv.items():
            log(f"{name} c={c} (medians): {m['tokens_per_s']:.1f} tok/s, TTFT p50 "
                f"{m['ttft_p50_s'] * 1e3:.0f} ms, ITL p50 {m['itl_p50_s'] * 1e3:.1f} ms")
    if "pdmesh" in runs and "llama-server" in runs:
        res["pdmesh_over_llama_server"] = {
            c: statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in
                                 zip(runs["pdmesh"][c], runs["llama-server"][c]))
            for c in LEVELS}
        res["ttft_p50_pdmesh_over_llama_server"] = {
            c: statistics.median(a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in
                                 zip(runs["pdmesh"][c], runs["llama-server"][c]))
            for c in LEVELS}
        log(f"pdmesh / llama-server tokens/s: {res['pdmesh_over_llama_server']}")
        log(f"pdmesh / llama-server TTFT p50: {res['ttft_p50_pdmesh_over_llama_server']}")
    save(res, out, "llamacpp", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
