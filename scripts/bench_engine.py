"""Engine benchmark: transformers generate vs our engine, one at a time and batched.

  (a) transformers `generate`, one request at a time
  (b) our engine, one request at a time
  (c) our engine with continuous batching at concurrency 4 and 16
plus the memory-bandwidth bound for decode at concurrency 1: weight bytes read per
token / measured memcpy bandwidth. Each weight-only quantization in --quantize (int8,
int4; shared/engine/quant.py) is one more engine, interleaved with the others prompt by
prompt at c=1, with its own bound (its own weight bytes) beside the unquantized one.
Everything is measured in one run; writes JSON + PNG.

    python scripts/bench_engine.py --model PATH [--dtype bfloat16] [--max-tokens 64]
        [--quantize ,int8,int4] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pdmesh.bench.workloads import CODE_PROMPTS
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]



def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


DEVICE = "cpu"          # --device: where the engines (and transformers) run


def _sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def memcpy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> dict:
    src = torch.ones(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: (dst.copy_(src), _sync())) for _ in range(reps))
    return {"copy_bytes_per_s": nbytes / best, "traffic_bytes_per_s": 2 * nbytes / best}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()


def hf_one(model, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds for max_tokens tokens, per-token decode latency) with HF generate."""
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids], device=DEVICE)
    with torch.inference_mode():
        t1 = _timed(lambda: model.generate(x, max_new_tokens=1, **gen))
        tn = _timed(lambda: model.generate(x, max_new_tokens=max_tokens, **gen))
    return tn, (tn - t1) / (max_tokens - 1)


def make_engine(path, dtype: str, concurrency: int, quantize: str = "") -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=path, dtype=dtype, num_blocks=2048, block_size=16,
                                 max_num_seqs=concurrency, max_num_batched_tokens=512,
                                 chunk_size=512, quantize=quantize, device=DEVICE))
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    return eng


def engine_run(eng: LLMEngine, prompts, max_tokens: int) -> tuple[float, int, list[float]]:
    """Run prompts together; (seconds, tokens, decode-step seconds with all running)."""
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for j, ids in enumerate(prompts):
        eng.add_request(f"b{time.monotonic_ns()}-{j}", ids, p)
    t0, tokens, full = time.perf_counter(), 0, []
    while eng.has_unfinished:
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if len(outs) == min(len(prompts), eng.cfg.max_num_seqs) and tokens >= len(outs):
            # a pure decode step with the batch full
            full.append(dt)
        tokens += len(outs)
    return time.perf_counter() - t0, tokens, full


def variant(q: str) -> str:
    return "engine" if not q else f"engine_{q}"


def bench_c1(path, dtype: str, prompts, max_tokens: int, quants: list[str]
             ) -> tuple[dict, dict, dict]:
    """(a) and (b) interleaved prompt by prompt (every quantization too), so machine load
    hits all alike. Returns runs, weight bytes and decode-step seconds per engine."""
    model = load_hf(path, getattr(torch, dtype))
    engines = {variant(q): make_engine(path, dtype, 1, q) for q in quants}
    hf_one(model, prompts[0], 4)
    hf_t = hf_tok = 0.0
    hf_lat = []
    acc = {v: [0.0, 0, []] for v in engines}      # seconds, tokens, step latencies
    for i, ids in enumerate(prompts):
        t, lat = hf_one(model, ids, max_tokens)
        hf_t, hf_tok = hf_t + t, hf_tok + max_tokens
        hf_lat.append(lat)
        for v, eng in engines.items():
            t, n, steps = engine_run(eng, [ids], max_tokens)
            acc[v][0] += t
            acc[v][1] += n
            acc[v][2] += steps
        log(f"  c=1 prompt {i + 1}/{len(prompts)}: decode tok/s hf {1 / hf_lat[-1]:.0f} vs "
            + ", ".join(f"{v} {len(a[2]) / sum(a[2]):.0f}" for v, a in acc.items()))
    runs = {"hf_c1": {"tokens_per_s": hf_tok / hf_t,
                      "per_token_latency_s": sum(hf_lat) / len(hf_lat)}}
    for v, (t, n, lat) in acc.items():
        runs[f"{v}_c1"] = {"tokens_per_s": n / t, "per_token_latency_s": sum(lat) / len(lat),
                           "per_token_latency_p50_s": sorted(lat)[len(lat) // 2]}
    return runs, {v: e.model.weight_bytes for v, e in engines.items()}


def bench_batched(path, dtype: str, prompts, max_tokens: int, concurrency: int,
                  quantize: str = "") -> dict:
    eng = make_engine(path, dtype, concurrency, quantize)
    t, n, steps = engine_run(eng, prompts, max_tokens)
    return {"tokens_per_s": n / t, "per_token_latency_s": sum(steps) / max(1, len(steps))}


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    ax[0].bar(names, [results["runs"][n]["tokens_per_s"] for n in names], color="tab:blue")
    ax[0].set_ylabel("output tokens/s")
    c1 = [n for n in names if n.endswith("_c1")]
    ax[1].bar(c1, [results["runs"][n]["per_token_latency_s"] * 1e3 for n in c1],
              color="tab:orange")
    for i, (v, b) in enumerate(results["bandwidth_bound_s_by_engine"].items()):
        ax[1].axhline(b * 1e3, ls="--", c=f"C{i + 2}", label=f"bandwidth bound {v}")
    ax[1].set_ylabel("c=1 per-token latency (ms)")
    ax[1].legend(fontsize=8)
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{results['model']} ({results['dtype']}, {results['threads']} threads)")
    fig.tight_layout()
    fig.savefig(out)


def ratios(runs: dict, bounds: dict) -> dict:
    base = runs["hf_c1"]["tokens_per_s"]
    out = {f"{n}_vs_hf_tokens_per_s": r["tokens_per_s"] / base
           for n, r in runs.items() if n != "hf_c1"}
    for v, b in bounds.items():
        lat = runs[f"{v}_c1"]["per_token_latency_s"]
        out[f"{v}_c1_latency_vs_bandwidth_bound"] = lat / b
        out[f"{v}_c1_fraction_of_bandwidth_bound"] = b / lat
        # against the unquantized weights' bound: what quantization buys
        out[f"{v}_c1_fraction_of_unquantized_bound"] = bounds["engine"] / lat if (
            "engine" in bounds) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--quantize", default=",int8,int4",
                    help="comma-separated engines at c=1 ('' = unquantized)")
    ap.add_argument("--batched", default="", help="the same for c=4/16 (default: --quantize)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    prompts = [tok.encode(p) for p in (CODE_PROMPTS * 2)[:args.prompts]]
    quants = args.quantize.split(",")
    log(f"model {args.model} dtype {args.dtype} threads {torch.get_num_threads()} "
        f"engines {[variant(q) for q in quants]}")
    bw = memcpy_bandwidth()
    log(f"memcpy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s copied")
    log("(a) transformers generate and (b) our engines, one request at a time, interleaved")
    runs, wbytes = bench_c1(args.model, args.dtype, prompts, args.max_tokens, quants)
    for q in dict.fromkeys(args.batched.split(",") if args.batched else quants):
        for c in (4, 16):
            log(f"(c) {variant(q)}, continuous batching at concurrency {c}")
            # the same 16 requests each time; only the concurrency changes
            runs[f"{variant(q)}_c{c}"] = bench_batched(args.model, args.dtype,
                                                       (prompts * 16)[:16], args.max_tokens, c, q)
    bw_after = memcpy_bandwidth()
    bounds = {v: b / bw["copy_bytes_per_s"] for v, b in wbytes.items()}
    res = {
        "model": Path(args.model).name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "device": args.device,
        "max_tokens": args.max_tokens, "prompts": len(prompts), "memcpy": bw,
        "memcpy_after": bw_after, "weight_bytes_per_token": wbytes.get("engine"),
        "bandwidth_bound_s": bounds.get("engine"), "weight_bytes_by_engine": wbytes,
        "bandwidth_bound_s_by_engine": bounds, "runs": runs, "ratios": ratios(runs, bounds),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"engine_{res['model']}_{args.dtype}" + ("" if args.device == "cpu" else "_cuda")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot(res, out / f"{stem}.png")
    log(json.dumps(res["ratios"], indent=2))
    log(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
