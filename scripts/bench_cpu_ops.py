"""The C++ CPU ops and prepacked W8A8 (kernels/cpu_ops, quant._prepack) against the torch
path they replace, side by side in one run.

Each configuration is an engine in its own process (the switches are read at load):
  torch      PDMESH_CPU_EXT=0 PDMESH_NO_PREPACK=1   (what the engine did before)
  c++        PDMESH_NO_PREPACK=1                      (C++ activation passes, in-place attention)
  c++ + prepack                                       (the default)
run alternately `--rounds` times, as `make run` configures decode (int4, act_int8,
SmoothQuant, head_split, one thread). Per concurrency: decode tokens/s over the steps where
every sequence decodes (prefill excluded), and how far the greedy tokens agree with the
torch configuration's: the W8A8 ops give the torch reference's bits, the in-place decode
attention is float32 math in another order (close, not equal), and without deterministic
mode batch composition changes the numerics anyway. Writes <out>/cpu_ops_<model>.json, .png.

    python scripts/bench_cpu_ops.py --model ~/.cache/pdmesh/models/SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdmesh.bench.alternate import alternate

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {"torch": {"PDMESH_CPU_EXT": "0", "PDMESH_NO_PREPACK": "1"},
           "c++": {"PDMESH_NO_PREPACK": "1"},
           "c++ + prepack": {}}
LEVELS = (1, 4, 16)


def log(msg: str) -> None:
    print(f"[cpu_ops {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child(model: str, tokens: int) -> dict:
    """One engine: decode tokens/s per level, and the tokens."""
    import torch

    from pdmesh.bench.engine_steps import decode_level
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantize="int4", act_int8=True,
                                 smoothquant=True, head_split=True, threads=1,
                                 kv_cache_mb=256, deterministic=False))
    out = {}
    for c in LEVELS:
        tps, toks = decode_level(eng, c, tokens)
        out[str(c)] = {"tokens_per_s": tps, "tokens": [toks[k] for k in sorted(toks)]}
    return out


def agreement(got: list[list[list[int]]], ref: list[list[list[int]]]) -> dict:
    """Sequences with the same greedy tokens as torch's, and the mean share of tokens before
    the first difference."""
    pairs = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
    prefix = []
    for a, b in pairs:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(b)))
    return {"identical_sequences": sum(a == b for a, b in pairs) / len(pairs),
            "mean_common_prefix": sum(prefix) / len(prefix), "sequences": len(pairs)}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(CONFIGS)
    for j, name in enumerate(CONFIGS):
        ys = [res["median_tokens_per_s"][name][str(c)] for c in LEVELS]
        ax.bar([i + j * w for i in range(len(LEVELS))], ys, w, label=name)
    ax.set_xticks([i + w for i in range(len(LEVELS))], [f"c={c}" for c in LEVELS])
    ax.set_ylabel("decode tokens/s (median of rounds)")
    ax.set_title(f"{res['model']}: C++ CPU ops / prepacked W8A8 vs torch (one thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "pdmesh" / "models"
                                           / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.tokens)))
        return 0
    runs = alternate(__file__, ["--model", args.model, "--tokens", str(args.tokens)], CONFIGS,
                     args.rounds, log, lambda got: ", ".join(
                         f"c={c} {got[str(c)]['tokens_per_s']:.1f} tok/s" for c in LEVELS))
    ref = runs["torch"][0]
    same = {name: agreement([run[str(c)]["tokens"] for run in rs for c in LEVELS],
                            [ref[str(c)]["tokens"] for _ in rs for c in LEVELS])
            for name, rs in runs.items()}
    med = {name: {str(c): statistics.median(run[str(c)]["tokens_per_s"] for run in rs)
                  for c in LEVELS} for name, rs in runs.items()}
    res = {"model": Path(args.model).name, "rounds": args.rounds, "tokens": args.tokens,
           "configs": {k: v for k, v in CONFIGS.items()}, "median_tokens_per_s": med,
           "speedup_vs_torch": {name: {c: med[name][c] / med["torch"][c] for c in med[name]}
                                for name in med},
           "greedy_agreement_with_torch": same,
           "runs": {name: [{c: run[c]["tokens_per_s"] for c in run} for run in rs]
                    for name, rs in runs.items()},
           "date": time.strftime("%Y-%m-%d %H:%M")}
    from pdmesh.bench.report import save

    path = save(res, args.out, "cpu_ops_" + res["model"], plot)
    log(f"speedup vs torch: {res['speedup_vs_torch']}; agreement: {same}; {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
