"""Plain bfloat16 weights on this CPU (`--quantize none`, and every tiny test model): torch's
bfloat16 GEMM against model.linear's float32 path (shared/engine/model.py: the weight
widened each call, summed in float32, rounded once), side by side in one process,
alternating. Where the CPU has bfloat16 dot products (AVX512-BF16, AMX) linear keeps
torch's GEMM, and both columns are that.

  matmul   SmolLM2-135M's shapes (q|k|v, o, gate|up, down, the LM head) at 2-512 rows
           (below 8 rows, 32 for the head, linear keeps torch's GEMM: both columns equal)
  engine   an engine on a model (bfloat16, no quantization, one thread): the prefill of one
           512-token prompt, then decode tokens/s with 8 streams

Writes <out>/bf16_linear_<model>_<cpu>.json and .png.

    python scripts/bench_bf16_linear.py [--model models/tiny-target] [--rounds 3] [--out docs/bench]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdmesh.bench.report import save
from shared.engine import model as engine_model

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
ROWS = (2, 4, 8, 16, 32, 128, 512)
PREFILL, STREAMS, TOKENS = 512, 8, 48


def log(msg: str) -> None:
    print(f"[bf16_linear {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ms(fn, reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def matmul_ms(rounds: int) -> dict:
    """Per shape and row count: torch's bfloat16 GEMM and model.linear (ms, medians)."""
    torch.manual_seed(0)
    out: dict = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        out[name] = {}
        for m in ROWS:
            if name == "head" and m > 32:       # the head sees one row per sequence
                continue
            x = torch.randn(m, k).to(torch.bfloat16)
            runs: dict[str, list[float]] = {"torch_bf16": [], "linear": []}
            for _ in range(rounds):
                runs["torch_bf16"].append(_ms(lambda: F.linear(x, w)))
                runs["linear"].append(_ms(lambda: engine_model.linear(x, w)))
            out[name][str(m)] = {k_: statistics.median(v) for k_, v in runs.items()}
        log(f"{name}: " + ", ".join(f"{m} rows {v['torch_bf16'] / v['linear']:.1f}x"
                                    for m, v in out[name].items()))
    return out


def engine_run(path: str) -> dict:
    from pdmesh.bench.engine_steps import prefill_then_decode
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=path, dtype="bfloat16", quantize="", threads=1,
                                 kv_cache_mb=256, deterministic=False))
    res = prefill_then_decode(eng, PREFILL, (STREAMS,), TOKENS)
    return {"prefill_512_s": res[f"prefill_{PREFILL}_s"], "decode_tok_s": res[str(STREAMS)]}


def engine_ab(path: str, rounds: int) -> dict:
    """The same engine run with linear's float32 path off (torch's GEMM) and on, alternating."""
    native = engine_model.NATIVE_BF16
    runs: dict[str, list[dict]] = {"torch_bf16": [], "linear": []}
    try:
        for r in range(rounds):
            order = ("torch_bf16", "linear") if r % 2 == 0 else ("linear", "torch_bf16")
            for name in order:
                engine_model.NATIVE_BF16 = True if name == "torch_bf16" else native
                runs[name].append(engine_run(path))
                log(f"round {r + 1} {name}: {runs[name][-1]}")
    finally:
        engine_model.NATIVE_BF16 = native
    return {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            for name, rs in runs.items()}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, by_m in res["matmul_ms"].items():
        ms = list(by_m)
        a.plot([int(m) for m in ms], [by_m[m]["torch_bf16"] / by_m[m]["linear"] for m in ms],
               marker="o", label=name)
    a.set_xscale("log", base=2)
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xlabel("rows")
    a.set_title("SmolLM2-135M's matmuls: torch bf16 ms / linear ms")
    a.legend()
    e = res["engine"]
    keys = (("prefill 512 tokens (1/s)", lambda d: 1 / d["prefill_512_s"]),
            (f"decode tok/s, {STREAMS} streams", lambda d: d["decode_tok_s"]))
    b.bar(range(len(keys)), [f(e["linear"]) / f(e["torch_bf16"]) for _, f in keys],
          color="tab:green")
    b.set_xticks(range(len(keys)), [k for k, _ in keys])
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_title(f"engine on {res['model']}: linear over torch bf16 (speed)")
    fig.suptitle(f"{res['cpu']} (bfloat16 dot products: {res['native_bf16']}), one thread, "
                 f"medians of {res['rounds']} alternating rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    flags = open("/proc/cpuinfo").read()
    cpu = "avx512" if " avx512f " in flags else ("avx2" if " avx2 " in flags else "other")
    res = {"model": Path(a.model).name, "cpu": cpu, "native_bf16": engine_model.NATIVE_BF16,
           "rounds": a.rounds, "matmul_ms": matmul_ms(a.rounds),
           "engine": engine_ab(a.model, a.rounds)}
    path = save(res, a.out, f"bf16_linear_{res['model']}_{cpu}", plot)
    e = res["engine"]
    log(f"engine: prefill {e['torch_bf16']['prefill_512_s'] / e['linear']['prefill_512_s']:.2f}x, "
        f"decode {e['linear']['decode_tok_s'] / e['torch_bf16']['decode_tok_s']:.2f}x; "
        f"wrote {path}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
