"""Engine benchmark: transformers generate vs our engine, one at a time and batched.

  (a) transformers `generate`, one request at a time
  (b) our engine, one request at a time
  (c) our engine with continuous batching at concurrency 4 and 16
plus the memory-bandwidth bound for decode at concurrency 1: weight bytes read per
token / measured memcpy bandwidth. Everything is measured in one run; writes JSON + PNG.

    python scripts/bench_engine.py --model PATH [--dtype bfloat16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.contracts.sampling import SamplingParams  # noqa: E402
from shared.engine.config import EngineConfig  # noqa: E402
from shared.engine.engine import LLMEngine  # noqa: E402
from tests.conftest import CODE_PROMPTS  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def memcpy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> dict:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return {"copy_bytes_per_s": nbytes / best, "traffic_bytes_per_s": 2 * nbytes / best}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_one(model, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds for max_tokens tokens, per-token decode latency) with HF generate."""
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])
    with torch.inference_mode():
        t1 = _timed(lambda: model.generate(x, max_new_tokens=1, **gen))
        tn = _timed(lambda: model.generate(x, max_new_tokens=max_tokens, **gen))
    return tn, (tn - t1) / (max_tokens - 1)


def make_engine(path, dtype: str, concurrency: int) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=path, dtype=dtype, num_blocks=2048, block_size=16,
                                 max_num_seqs=concurrency, max_num_batched_tokens=512,
                                 chunk_size=512))
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


def bench_c1(path, dtype: str, prompts, max_tokens: int) -> tuple[dict, dict, int]:
    """(a) and (b) interleaved prompt by prompt, so machine load hits both alike."""
    model = load_hf(path, getattr(torch, dtype))
    eng = make_engine(path, dtype, 1)
    hf_one(model, prompts[0], 4)
    hf_t = hf_tok = eng_t = eng_tok = 0.0
    hf_lat, eng_lat = [], []
    for i, ids in enumerate(prompts):
        t, lat = hf_one(model, ids, max_tokens)
        hf_t, hf_tok = hf_t + t, hf_tok + max_tokens
        hf_lat.append(lat)
        t, n, steps = engine_run(eng, [ids], max_tokens)
        eng_t, eng_tok = eng_t + t, eng_tok + n
        eng_lat += steps
        log(f"  c=1 prompt {i + 1}/{len(prompts)}: decode tok/s hf {1 / hf_lat[-1]:.0f} "
            f"vs engine {len(steps) / sum(steps):.0f}")
    return ({"tokens_per_s": hf_tok / hf_t, "per_token_latency_s": sum(hf_lat) / len(hf_lat)},
            {"tokens_per_s": eng_tok / eng_t, "per_token_latency_s": sum(eng_lat) / len(eng_lat)},
            eng.model.weight_bytes)


def bench_batched(path, dtype: str, prompts, max_tokens: int, concurrency: int) -> dict:
    eng = make_engine(path, dtype, concurrency)
    t, n, steps = engine_run(eng, prompts, max_tokens)
    return {"tokens_per_s": n / t, "per_token_latency_s": sum(steps) / max(1, len(steps))}


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar(names, [results["runs"][n]["tokens_per_s"] for n in names], color="tab:blue")
    ax[0].set_ylabel("output tokens/s")
    ax[1].bar(names, [results["runs"][n]["per_token_latency_s"] * 1e3 for n in names],
              color="tab:orange")
    ax[1].axhline(results["bandwidth_bound_s"] * 1e3, ls="--", c="k", label="bandwidth bound")
    ax[1].set_ylabel("per-token latency (ms)")
    ax[1].legend()
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{results['model']} ({results['dtype']})")
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    prompts = [tok.encode(p) for p in (CODE_PROMPTS * 2)[:args.prompts]]
    log(f"model {args.model} dtype {args.dtype} threads {torch.get_num_threads()}")
    bw = memcpy_bandwidth()
    log(f"memcpy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s copied")
    runs = {}
    log("(a) transformers generate and (b) our engine, one request at a time, interleaved")
    runs["hf_c1"], runs["engine_c1"], wbytes = bench_c1(args.model, args.dtype, prompts,
                                                        args.max_tokens)
    for c in (4, 16):
        log(f"(c) engine, continuous batching at concurrency {c}")
        # the same 16 requests each time; only the concurrency changes
        runs[f"engine_c{c}"] = bench_batched(args.model, args.dtype, (prompts * 16)[:16],
                                             args.max_tokens, c)
    bound = wbytes / bw["copy_bytes_per_s"]
    base = runs["hf_c1"]["tokens_per_s"]
    res = {
        "model": Path(args.model).name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens, "prompts": len(prompts), "memcpy": bw,
        "weight_bytes_per_token": wbytes, "bandwidth_bound_s": bound, "runs": runs,
        "ratios": {
            "engine_c1_vs_hf_tokens_per_s": runs["engine_c1"]["tokens_per_s"] / base,
            "engine_c4_vs_hf_tokens_per_s": runs["engine_c4"]["tokens_per_s"] / base,
            "engine_c16_vs_hf_tokens_per_s": runs["engine_c16"]["tokens_per_s"] / base,
            "engine_c1_latency_vs_bandwidth_bound":
                runs["engine_c1"]["per_token_latency_s"] / bound,
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"engine_{res['model']}_{args.dtype}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot(res, out / f"{stem}.png")
    log(json.dumps(res["ratios"], indent=2))
    log(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
