"""The C++ matmuls of quantized weights (kernels/cpu_ops: int8_gemv.cpp for the LM head,
int4_gemv.cpp for the int4 body) against torch's kernels, side by side in one run, on
this CPU: the head alone (SmolLM2's 49152 x 576 int8), one int4 weight alone (SmolLM2's
gate|up, 3072 x 576), and the engine as `pdmesh up` configures decode (int4 body, int8
head split over two threads, one thread; no speculation, so that steps are comparable):
decode tokens/s at 1, 4 and 16 streams and the prefill of one 512-token prompt. Each
configuration runs in its own process, alternating:

  torch   PDMESH_CPU_GEMV=0   (torch's int8 and int4 kernels: what AVX2 CPUs got before)
  c++     the default          (the C++ kernels the build has: AVX-512 or AVX2)

Writes <out>/cpu_gemv_<avx512|avx2>.json and .png.

    python scripts/bench_cpu_gemv.py [--rounds 3] [--out docs/bench]
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
CONFIGS = {"torch": {"PDMESH_CPU_GEMV": "0"}, "c++": {}}
ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
LEVELS = (1, 4, 16)
PREFILL = 512


def log(msg: str) -> None:
    print(f"[cpu_gemv {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def matmul_ms() -> dict:
    """The head's and gate|up's x @ w.T per row count (ms, the median of 7), as Int8Weight
    and Int4Weight route them."""
    import torch

    from shared.engine.quant import Int4Weight, Int8Weight

    torch.manual_seed(0)
    weights = {"head_int8": Int8Weight((torch.randn(49152, 576) * 0.05).to(torch.bfloat16)),
               "gate_up_int4": Int4Weight((torch.randn(3072, 576) * 0.05).to(torch.bfloat16))}
    out: dict = {}
    for name, w in weights.items():
        mm = w.raw_mm if name == "head_int8" else w.mm
        out[name] = {}
        for m in ROWS:
            if name == "head_int8" and m > 16:
                continue
            x = torch.randn(m, 576).to(torch.bfloat16)
            mm(x)
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                mm(x)
                ts.append((time.perf_counter() - t) * 1e3)
            out[name][str(m)] = statistics.median(ts)
    return out


def decode_tps(model: str, tokens: int) -> dict:
    """Decode tokens/s per level over the steps where every sequence decodes."""
    from pdmesh.bench.engine_steps import prefill_then_decode
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantize="auto",
                                 head_split=True, batch_helper=True, threads=1,
                                 kv_cache_mb=256, deterministic=False))
    return prefill_then_decode(eng, PREFILL, LEVELS, tokens)


def child(model: str, tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)
    return {"matmul_ms": matmul_ms(), "engine": decode_tps(model, tokens)}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = res["speedup"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in ((axes[0], "head_int8", "LM head (int8)"),
                           (axes[1], "gate_up_int4", "gate|up (int4)")):
        rows = list(sp["matmul"][key])
        ax.bar(range(len(rows)), [sp["matmul"][key][m] for m in rows], color="tab:orange")
        ax.set_xticks(range(len(rows)), [f"{m}" for m in rows])
        ax.set_xlabel("rows")
        ax.set_title(f"{label}: torch ms / c++ ms")
    eng = list(sp["engine"])
    axes[2].bar(range(len(eng)), [sp["engine"][k] for k in eng], color="tab:green")
    axes[2].set_xticks(range(len(eng)), [k.replace("_s", "").replace("prefill_512", "prefill 512")
                                         if k.startswith("prefill") else f"decode c={k}"
                                         for k in eng], rotation=15)
    axes[2].set_title("engine: c++ over torch (speed)")
    for ax in axes:
        ax.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"{res['model']}, {res['cpu']}: C++ quantized matmuls vs torch's (one thread,"
                 f" medians of {res['rounds']} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu() -> str:
    flags = open("/proc/cpuinfo").read()
    return "avx512" if " avx512f " in flags else ("avx2" if " avx2 " in flags else "other")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "pdmesh" / "models"
                                           / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.tokens)))
        return 0
    from shared.engine.gguf_convert import convert
    convert(Path(args.model))
    runs = alternate(__file__, ["--model", args.model, "--tokens", str(args.tokens)], CONFIGS,
                     args.rounds, log, lambda got: json.dumps(
                         {k: {m: round(v, 3) for m, v in d.items()}
                          for k, d in got["matmul_ms"].items()})
                     + " " + json.dumps({k: round(v, 3) for k, v in got["engine"].items()}))

    def median(name: str, *keys: str) -> float:
        vals = []
        for run in runs[name]:
            v = run
            for k in keys:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)

    first = runs["torch"][0]
    speedup = {"matmul": {w: {m: median("torch", "matmul_ms", w, m)
                              / median("c++", "matmul_ms", w, m) for m in d}
                          for w, d in first["matmul_ms"].items()},
               "engine": {k: (median("torch", "engine", k) / median("c++", "engine", k)
                              if k.startswith("prefill") else
                              median("c++", "engine", k) / median("torch", "engine", k))
                          for k in first["engine"]}}
    res = {"cpu": cpu(), "model": Path(args.model).name, "rounds": args.rounds,
           "tokens": args.tokens, "configs": CONFIGS, "speedup": speedup,
           "median": {name: {"matmul_ms": {w: {m: median(name, "matmul_ms", w, m) for m in d}
                                           for w, d in first["matmul_ms"].items()},
                             "engine": {k: median(name, "engine", k) for k in first["engine"]}}
                      for name in CONFIGS},
           "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M")}
    from pdmesh.bench.report import save

    path = save(res, args.out, f"cpu_gemv_{res['cpu']}", plot)
    log(f"speedup (c++ over torch): {json.dumps(speedup)}; {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
