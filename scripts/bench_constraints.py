"""Constrained decoding cost: per-token latency with vs without a grammar (same engine,
same prompts, interleaved rounds), grammar compile time cold, and the compile cache hit
rate over a workload that reuses tool sets. Writes JSON + PNG.

    python scripts/bench_constraints.py --model models/tiny-target [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pdmesh.bench.workloads import CANON, SCHEMA, TOOLS
from shared.contracts.constraint import Constraint, ConstraintKind
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]



def log(msg):
    print(f"[bench-constraints {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def per_token_ms(eng, ids, constraint, n_tokens):
    """Mean decode-step time for one request (prefill step excluded)."""
    eng.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                             ignore_eos=True), constraint=constraint)
    times, produced = [], 0
    while eng.has_unfinished:
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if produced:                 # skip the prefill step
            times.append(dt)
        produced += sum(len(o.new_token_ids) for o in outs)
    return 1e3 * statistics.mean(times), produced


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=256))
    tok = eng.tokenizer
    kinds = {
        "json_schema": Constraint(kind=ConstraintKind.JSON_SCHEMA,
                                  json_schema=json.dumps(SCHEMA, **CANON)),
        "tools_required": Constraint(kind=ConstraintKind.TOOLS_REQUIRED,
                                     tools=json.dumps(TOOLS, **CANON)),
    }
    ids = tok.encode_chat([{"role": "user", "content": "Book a flight and check weather."}],
                          tools=TOOLS)
    t0 = time.perf_counter()
    eng.grammar                      # tokenizer info: built once per engine
    setup_s = time.perf_counter() - t0
    compile_ms = {}
    for name, c in kinds.items():
        t = time.perf_counter()
        eng.grammar.compile(c)
        compile_ms[name] = 1e3 * (time.perf_counter() - t)
    log(f"grammar setup {setup_s:.2f}s, cold compile ms {compile_ms}")
    lat = {"none": [], **{k: [] for k in kinds}}
    for r in range(args.rounds):         # interleaved: load noise hits every variant alike
        lat["none"].append(per_token_ms(eng, ids, None, args.tokens)[0])
        for name, c in kinds.items():
            # greedy runs may end early when the grammar completes: report per token
            lat[name].append(per_token_ms(eng, ids, c, args.tokens)[0])
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in lat.items()))
    med = {k: statistics.median(v) for k, v in lat.items()}
    # cache behaviour: 200 requests drawing from 10 distinct tool subsets
    rng = random.Random(0)
    subsets = [rng.sample(TOOLS, rng.randint(1, len(TOOLS))) for _ in range(10)]
    before = eng.grammar.stats()
    for _ in range(200):
        eng.grammar.compile(Constraint(kind=ConstraintKind.TOOLS_REQUIRED,
                                       tools=json.dumps(rng.choice(subsets), **CANON)))
    after = eng.grammar.stats()
    hits, misses = after.hits - before.hits, after.misses - before.misses
    res = {"model": Path(args.model).name, "dtype": args.dtype, "tokens": args.tokens,
           "grammar_setup_s": setup_s, "cold_compile_ms": compile_ms,
           "per_token_ms_median": med,
           "overhead_ms_per_token": {k: med[k] - med["none"] for k in kinds},
           "overhead_ratio": {k: med[k] / med["none"] for k in kinds},
           "cache": {"requests": 200, "distinct": 10, "hits": hits, "misses": misses,
                     "hit_rate": hits / (hits + misses)}, "raw_ms": lat}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"constraints_{res['model']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(med), list(med.values()), color=["tab:gray", "tab:blue", "tab:orange"])
    ax.set_ylabel("decode ms / token (median of rounds)")
    ax.set_title(f"constrained decoding, {res['model']}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"))
    log(json.dumps({k: res[k] for k in ("per_token_ms_median", "overhead_ratio", "cache")}))
    log(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
