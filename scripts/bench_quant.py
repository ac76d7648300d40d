"""What weight-only quantization costs in accuracy and buys in speed (shared/engine/quant.py).

For each engine (unquantized, int8, int4), in one run:
  - perplexity on held-out text: English prose (Python's own reference documentation,
    pydoc_data.topics, which ships with every Python) and code (stdlib sources), in
    non-overlapping windows; plus, per position, the top-1 agreement with the unquantized
    model and the mean KL(unquantized || quantized) of the next-token distribution;
  - greedy agreement on generation: chat and code prompts, N output tokens each: the
    share of tokens equal to the unquantized engine's before the first divergence, and
    the share of whole outputs that are identical;
  - c=1 decode step latency, the engines interleaved step by step.
Round-to-nearest needs no calibration data; SmoothQuant ("+sq") calibrates on
shared/engine/calibration.txt, which holds none of these texts, so every text here is
held out.

    python scripts/bench_quant.py [--model PATH] [--dtype bfloat16] [--quantize int8,int4]
    (a mode with "+a8", e.g. int4+a8, also sets act_int8: batches on int8 activations;
    "+a8+sq" also sets smoothquant: q|k|v and down too, SmoothQuant-calibrated)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdmesh.bench.quality import held_out_texts, text_metrics
from pdmesh.bench.report import save
from pdmesh.bench.workloads import CODE_PROMPTS
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.gguf_convert import default_model_dir

ROOT = Path(__file__).resolve().parents[1]


CHAT_PROMPTS = ["What is the capital of France?", "Give me three tips for sleeping better.",
                "Explain what a hash table is.", "Write a haiku about autumn.",
                "What is 17 times 23?", "Summarize the plot of Romeo and Juliet.",
                "How do I reverse a list in Python?", "Why is the sky blue?"]


def log(msg: str) -> None:
    print(f"[quant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def greedy_agreement(engines: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {v: [r["token_ids"] for r in eng.generate(prompts, p)] for v, eng in engines.items()}
    ref = outs[next(iter(outs))]
    res = {}
    for v, got in outs.items():
        prefix = []
        for a, b in zip(got, ref):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            prefix.append(k / len(b))
        res[v] = {"prefix_agreement": sum(prefix) / len(prefix),
                  "identical_outputs": sum(a == b for a, b in zip(got, ref)) / len(ref),
                  "per_prompt_prefix": prefix}
    return res


def step_latency(engines: dict, prompt: list[int], steps: int) -> dict:
    p = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for v, eng in engines.items():
        eng.add_request("lat", prompt, p)
        eng.step()
        eng.step()
    times = {v: [] for v in engines}
    for _ in range(steps):
        for v, eng in engines.items():
            t = time.perf_counter()
            eng.step()
            times[v].append(time.perf_counter() - t)
    for eng in engines.values():
        eng.abort("lat")
    return {v: {"median_s": statistics.median(t), "weight_bytes": engines[v].model.weight_bytes}
            for v, t in times.items()}


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = list(res["latency"])
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for i, name in enumerate(res["text"]):
        ax[0].bar([x + 0.4 * i for x in range(len(vs))],
                  [res["text"][name][v]["perplexity"] for v in vs], 0.4, label=name)
    ax[0].set_xticks(range(len(vs)), vs)
    ax[0].set_ylabel("perplexity (held-out)")
    ax[0].legend()
    ax[1].bar(vs, [res["greedy"][v]["prefix_agreement"] for v in vs], color="tab:green")
    ax[1].set_ylabel(f"greedy agreement ({res['max_tokens']} tokens, before divergence)")
    ax[1].set_ylim(0, 1.05)
    ax[2].bar(vs, [res["latency"][v]["median_s"] * 1e3 for v in vs], color="tab:orange")
    ax[2].set_ylabel("c=1 decode step (ms, interleaved)")
    fig.suptitle(f"weight-only quantization: {res['model']} ({res['dtype']})")
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="int8,int4")
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = [""] + [q for q in args.quantize.split(",") if q]
    engines = {(q or args.dtype): LLMEngine(EngineConfig(     # "int4+a8": act_int8 on
        model=args.model, dtype=args.dtype, num_blocks=1024, max_num_seqs=16,
        max_num_batched_tokens=1024, chunk_size=1024, quantize=q.split("+")[0],
        act_int8="+a8" in q, smoothquant=q.endswith("+sq"))) for q in modes}
    tok = next(iter(engines.values())).tokenizer
    res = {"model": Path(args.model).name, "dtype": args.dtype, "threads": args.threads,
           "max_tokens": args.max_tokens, "text": {}}
    for name, text in held_out_texts().items():
        ids = tok.encode(text)[:args.text_tokens]
        log(f"perplexity on {name}: {len(ids)} tokens")
        res["text"][name] = text_metrics(engines, ids, args.window)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    prompts += [tok.encode(c) for c in CODE_PROMPTS[:8]]
    log(f"greedy agreement: {len(prompts)} prompts x {args.max_tokens} tokens")
    res["greedy"] = greedy_agreement(engines, prompts, args.max_tokens)
    log(f"decode step latency, {args.steps} steps interleaved")
    res["latency"] = step_latency(engines, prompts[0], args.steps)
    path = save(res, args.out, f"quant_{res['model']}_{args.dtype}", plot)
    log(json.dumps({n: {v: round(m["perplexity"], 3) for v, m in t.items()}
                    for n, t in res["text"].items()}))
    log(json.dumps({v: round(g["prefix_agreement"], 3) for v, g in res["greedy"].items()}))
    log(f"wrote {path}.json and .png")


if __name__ == "__main__":
    main()
