"""Where one token's time goes at one stream, and one first token's: the engine's step
taken apart (forward by op, sampling, detokenize and stop checks, the rest of the step),
then what the mesh adds on top (decode's loop, the chunk over NATS, the gateway, the SSE
write, the client's read), side by side in one run on the default model.

  engine  the decode engine `pdmesh up --no-speculation` runs (its decode settings:
          SmolLM2-135M, bf16, int4, head_split, the batch helper; one thread), in this
          process: one request, the README's question,
          --tokens tokens (ignore_eos). Each decode step's wall time and its parts
          (timers around the engine's own calls), and the forward's ops from
          torch.profiler over --profile-steps of those steps.
          And the same engine on 1 and 2 torch threads (s per token, interleaved).
  mesh    `pdmesh up --no-speculation` (else its defaults), the same request streamed
          through /v1/completions: the client's inter-chunk gaps and its TTFT. The mesh's
          share of a token is the client's median gap minus the engine's median step
          (the same work on the same core budget); of the first token, the client's TTFT
          minus the engine's prefill step.

    python scripts/bench_token_path.py [--tokens 128] [--rounds 3]

Writes docs/bench/token_path.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import torch

from pdmesh.bench.http import start_up, stop, timed_stream
from pdmesh.bench.report import save

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def log(msg: str) -> None:
    print(f"[token_path {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Timers:
    """Wall seconds per label, per step."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[label] += time.perf_counter() - t0
        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        return out


def op_group(name: str) -> str:
    """A profiler op name -> what it does in the forward."""
    n = name.lower()
    if any(k in n for k in ("int4", "int8", "quant", "pdmesh")):
        return "quantized matmul"
    if any(k in n for k in ("mm", "linear", "matmul", "bmm", "addmm")):
        return "matmul"
    if any(k in n for k in ("attention", "softmax", "index_select", "gather", "index")):
        return "attention"
    if any(k in n for k in ("rsqrt", "pow", "mean", "norm")):
        return "norm"
    if any(k in n for k in ("silu", "gelu", "sigmoid")):
        return "activation"
    if any(k in n for k in ("copy", "to", "cat", "empty", "zeros", "view", "reshape",
                            "transpose", "contiguous", "stack", "slice", "select")):
        return "copies and views"
    return "other ops"


@contextmanager
def labelled_cpu_ops():
    """The C++ CPU ops (pybind11 calls, unseen by torch.profiler) each inside a
    record_function named for op_group: its time shows as that label's self time."""
    from torch.profiler import record_function

    import kernels.cpu_ops as ops
    import kernels.cpu_ops.gemv as gemv
    import kernels.paged_attention as paged
    import shared.engine.attention as attention
    import shared.engine.quant as quant

    def labelled(fn, label):
        def call(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        return call

    spots = [(gemv, "int4_gemv", "pdmesh::int4_gemv"), (gemv, "int4_dequant", "pdmesh::int4_dequant"),
             (gemv, "int4_gemm", "pdmesh::int4_gemm"), (quant, "int8_gemm", "pdmesh::int8_gemm"),
             (quant, "int8_gemv", "pdmesh::int8_gemv"), (ops, "rms_norm", "cpp::rms_norm"),
             (ops, "rope", "cpp::rope"), (ops, "silu_mul", "cpp::silu_mul"),
             (paged, "decode_attention", "cpp::decode_attention"),
             (attention, "row_attention", "cpp::row_attention")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in spots]
    for mod, name, label in spots:
        setattr(mod, name, labelled(getattr(mod, name), label))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def up_engine(model: str, threads: int, kv_cache_mb: int):
    """An engine with the settings `pdmesh up --no-speculation` gives its decode (bf16, as
    decode's own default): what this benchmark measures is what users run."""
    from dataclasses import fields

    from pdmesh.cli import build_parser
    from pdmesh.local.serve_args import cluster_kwargs
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    up = cluster_kwargs(build_parser().parse_args(["up", "--no-speculation"]))
    names = {f.name for f in fields(EngineConfig)}
    kw = {k: v for k, v in up["overrides"].get("decode", {}).items() if k in names}
    return LLMEngine(EngineConfig(**kw | {"model": model, "dtype": "bfloat16",
                                          "threads": threads, "kv_cache_mb": kv_cache_mb}))


def engine_part(model: str, tokens: int, rounds: int, profile_steps: int) -> dict:
    import shared.engine.engine as engine_mod
    from shared.contracts.sampling import SamplingParams
    from shared.engine.output import OutputProcessor

    eng = up_engine(model, 1, 256)
    prompt = eng.tokenizer.encode_chat(QUESTION)
    t = Timers()
    t.wrap(engine_mod, "sample", "sampling")
    t.wrap(engine_mod, "build_batch", "batch build")
    t.wrap(OutputProcessor, "process", "detokenize + stop checks")
    t.wrap(eng.model, "forward", "forward")
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    t.take()                                      # (warm: the first forwards are slower)
    steps, prefill_s = [], []
    for r in range(rounds):
        eng.add_request(f"r{r}", prompt, sp)
        first = True
        while eng.has_unfinished:
            t0 = time.perf_counter()
            eng.step()
            wall = time.perf_counter() - t0
            parts = t.take()
            (prefill_s.append(wall) if first else steps.append(parts | {"step": wall}))
            first = False
    # the forward's ops, over decode steps only
    eng.add_request("prof", prompt, sp)
    eng.step()                                    # its prefill
    from torch.profiler import ProfilerActivity, profile
    with labelled_cpu_ops(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profile_steps):
            eng.step()
    while eng.has_unfinished:
        eng.step()
    by_group: dict[str, float] = defaultdict(float)
    by_op = {}
    for ev in prof.key_averages():
        by_group[op_group(ev.key)] += ev.self_cpu_time_total / 1e6
        by_op[ev.key] = ev.self_cpu_time_total / 1e6
    total = sum(by_group.values()) or 1.0
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    med = {k: statistics.median(s.get(k, 0.0) for s in steps)
           for k in ("step", "forward", "sampling", "detokenize + stop checks",
                     "batch build")}
    med["rest of the step"] = med["step"] - sum(v for k, v in med.items() if k != "step")
    return {"prompt_tokens": len(prompt), "decode_steps": len(steps),
            "prefill_step_s": statistics.median(prefill_s),
            "step_s": {k: round(v, 6) for k, v in med.items()},
            "forward_ops_share": {k: round(v / total, 4) for k, v in
                                  sorted(by_group.items(), key=lambda kv: -kv[1])},
            "forward_top_ops_share": {k: round(v / total, 4) for k, v in top}}


def threads_part(model: str, tokens: int, rounds: int) -> dict:
    """ms per token of the same engine on 1 and 2 torch threads, interleaved: whether
    lending decode the core prefill leaves idle would pay through intra-op threads."""
    from shared.contracts.sampling import SamplingParams

    engs = {n: up_engine(model, n, 128) for n in (1, 2)}
    prompt = engs[1].tokenizer.encode_chat(QUESTION)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got: dict[int, list[float]] = {n: [] for n in engs}
    for _ in range(rounds):
        for n, e in engs.items():
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            e.generate([prompt], sp)
            got[n].append((time.perf_counter() - t0) / tokens)
    torch.set_num_threads(1)
    return {f"threads_{n}_s_per_token": statistics.median(v) for n, v in got.items()}


async def stream_once(url: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        got = await timed_stream(http, url, body)
    assert got["ttft_s"] is not None and not got["error"], got
    return got["ttft_s"], got["gaps_s"]


def mesh_part(prompt: str, tokens: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_up(["--no-speculation"], Path(tmp) / "up.log")
        try:
            asyncio.run(stream_once(url, prompt, 8))          # warm
            ttfts, gaps = [], []
            for r in range(rounds):
                ttft, g = asyncio.run(stream_once(url, prompt, tokens))
                ttfts.append(ttft)
                gaps += g
                log(f"  mesh round {r + 1}/{rounds}: TTFT {ttft * 1e3:.1f} ms, gap p50 "
                    f"{statistics.median(g) * 1e3:.2f} ms")
        finally:
            stop(proc)
    gaps.sort()
    return {"ttft_s": statistics.median(ttfts), "gap_p50_s": statistics.median(gaps),
            "gap_p90_s": gaps[int(0.9 * (len(gaps) - 1))], "gaps": len(gaps)}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    e, m = res["engine"], res["mesh"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    parts = {k: v * 1e3 for k, v in e["step_s"].items() if k != "step"}
    parts["mesh (decode loop, NATS, gateway, SSE)"] = res["token_mesh_s"] * 1e3
    bottom = 0.0
    for k, v in parts.items():
        ax[0].bar(0, v, bottom=bottom, label=f"{k} {v:.2f} ms")
        bottom += v
    ax[0].set_xticks([0], ["one token (c=1)"])
    ax[0].set_ylabel("ms")
    ax[0].legend(fontsize=8)
    ax[0].set_title(f"client gap p50 {m['gap_p50_s'] * 1e3:.2f} ms")
    first = {"prefill step (engine)": e["prefill_step_s"] * 1e3,
             "mesh (hops, prefill job, KV, SSE)": res["first_token_mesh_s"] * 1e3}
    bottom = 0.0
    for k, v in first.items():
        ax[1].bar(0, v, bottom=bottom, label=f"{k} {v:.1f} ms")
        bottom += v
    ax[1].set_xticks([0], ["first token"])
    ax[1].legend(fontsize=8)
    ax[1].set_title(f"client TTFT p50 {m['ttft_s'] * 1e3:.1f} ms")
    ops = e["forward_ops_share"]
    ax[2].barh(list(ops), [v * 100 for v in ops.values()])
    ax[2].invert_yaxis()
    ax[2].set_xlabel("% of the forward's CPU time")
    ax[2].set_title("forward by op (decode steps)")
    fig.suptitle(f"{res['model']}: where a token's time goes at one stream")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    from shared.engine.gguf_convert import convert, default_model_dir
    model = str(convert(default_model_dir()))
    torch.set_num_threads(1)
    log(f"engine: {model}, {a.rounds} x {a.tokens} tokens")
    eng = engine_part(model, a.tokens, a.rounds, a.profile_steps)
    log(f"engine: {eng['step_s']} prefill {eng['prefill_step_s'] * 1e3:.1f} ms")
    eng["threads"] = threads_part(model, a.tokens, a.rounds)
    log(f"engine threads: {eng['threads']}")
    from shared.engine.tokenizer import Tokenizer
    prompt = Tokenizer.from_pretrained(model).hf.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True)
    log("mesh: pdmesh up --no-speculation")
    mesh = mesh_part(prompt, a.tokens, a.rounds)
    res = {"model": Path(model).name, "tokens": a.tokens, "rounds": a.rounds,
           "cpu_count": os.cpu_count(), "engine": eng, "mesh": mesh,
           "token_mesh_s": mesh["gap_p50_s"] - eng["step_s"]["step"],
           "first_token_mesh_s": mesh["ttft_s"] - eng["prefill_step_s"]}
    res["token_mesh_share"] = res["token_mesh_s"] / mesh["gap_p50_s"]
    path = save(res, a.out, "token_path", plot)
    log(f"one token: engine step {eng['step_s']['step'] * 1e3:.2f} ms, client gap "
        f"{mesh['gap_p50_s'] * 1e3:.2f} ms, mesh {res['token_mesh_s'] * 1e3:.2f} ms "
        f"({res['token_mesh_share']:.0%}); first token: prefill "
        f"{eng['prefill_step_s'] * 1e3:.1f} ms, TTFT {mesh['ttft_s'] * 1e3:.1f} ms")
    log(f"wrote {path}.json and .png")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
