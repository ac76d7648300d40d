"""The LM head's int8 kernel (kernels/cpu_ops/int8_gemv.cpp) against torch's
_weight_int8pack_mm, side by side in one run, on this CPU: the head alone (SmolLM2's
49152 x 576, one thread) and decode tokens/s of the engine as `pdmesh up` configures decode
(int4 body, int8 head split over two threads, batch helper, one thread; no speculation, so
that steps are comparable). Each engine runs in its own process, alternating:

  torch   PDMESH_CPU_GEMV=0   (torch's int8 and int4 kernels: what AVX2 CPUs got before)
  c++     the default          (int8_gemv wherever the build has it: AVX-512 or AVX2)

On an AVX-512 CPU both kernels already differed before; the AVX2 path is what this
measures there. Writes <out>/int8_head_<cpu>.json and .png.

    python scripts/bench_int8_head.py [--rounds 2] [--out docs/bench]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"torch": {"PDMESH_CPU_GEMV": "0"}, "c++": {}}
ROWS = (1, 2, 4, 8, 16)
LEVELS = (1, 4, 16)


def log(msg: str) -> None:
    print(f"[int8_head {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def head_ms() -> dict:
    """The head's x @ w.T per row count (ms, the median of 9), as Int8Weight routes it."""
    import torch

    from shared.engine.quant import Int8Weight

    torch.manual_seed(0)
    head = Int8Weight((torch.randn(49152, 576) * 0.05).to(torch.bfloat16))
    out = {}
    for m in ROWS:
        x = torch.randn(m, 576).to(torch.bfloat16)
        head.raw_mm(x)
        ts = []
        for _ in range(9):
            t = time.perf_counter()
            head.raw_mm(x)
            ts.append((time.perf_counter() - t) * 1e3)
        out[str(m)] = statistics.median(ts)
    return out


def decode_tps(model: str, tokens: int) -> dict:
    """Decode tokens/s per level over the steps where every sequence decodes."""
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantize="auto",
                                 head_split=True, batch_helper=True, threads=1,
                                 kv_cache_mb=256, deterministic=False))
    out = {}
    for c in LEVELS:
        for i in range(c):
            eng.add_request(f"{c}-{i}", list(range(200 + 13 * i, 240 + 17 * i)),
                            SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        seen: set[str] = set()
        decode_s, decode_tokens = 0.0, 0
        while eng.has_unfinished:
            prefilling = len(seen) < c
            t = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t
            if not prefilling:
                decode_s += dt
                decode_tokens += len(outs)
            seen.update(o.request_id for o in outs)
        out[str(c)] = decode_tokens / decode_s if decode_s else None
    return out


def child(model: str, tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)
    return {"head_ms": head_ms(), "decode_tokens_per_s": decode_tps(model, tokens)}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.4
    for j, name in enumerate(CONFIGS):
        a.bar([i + j * w for i in range(len(ROWS))],
              [res["median"][name]["head_ms"][str(m)] for m in ROWS], w, label=name)
        b.bar([i + j * w for i in range(len(LEVELS))],
              [res["median"][name]["decode_tokens_per_s"][str(c)] for c in LEVELS], w,
              label=name)
    a.set_xticks([i + w / 2 for i in range(len(ROWS))], [f"{m} rows" for m in ROWS])
    a.set_ylabel("LM head ms (lower is better)")
    b.set_xticks([i + w / 2 for i in range(len(LEVELS))], [f"c={c}" for c in LEVELS])
    b.set_ylabel("decode tokens/s (higher is better)")
    for ax in (a, b):
        ax.legend()
    fig.suptitle(f"int8 LM head, {res['cpu']}: int8_gemv vs torch (one thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu() -> str:
    flags = open("/proc/cpuinfo").read()
    return "avx512" if " avx512f " in flags else ("avx2" if " avx2 " in flags else "other")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    from shared.engine.gguf_convert import convert
    convert(Path(args.model))
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, env in CONFIGS.items():
            log(f"round {r + 1}/{args.rounds}: {name}")
            p = subprocess.run([sys.executable, __file__, "--child", "--model", args.model,
                                "--tokens", str(args.tokens)], env={**os.environ, **env},
                               capture_output=True, text=True, check=True, cwd=ROOT)
            got = json.loads(p.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            log("  head " + ", ".join(f"{m} rows {got['head_ms'][str(m)]:.2f} ms" for m in ROWS)
                + "; decode " + ", ".join(f"c={c} {got['decode_tokens_per_s'][str(c)]:.1f} tok/s"
                                          for c in LEVELS))
    med = {name: {key: {k: statistics.median(run[key][k] for run in rs) for k in rs[0][key]}
                  for key in ("head_ms", "decode_tokens_per_s")} for name, rs in runs.items()}
    res = {"cpu": cpu(), "model": Path(args.model).name, "rounds": args.rounds,
           "tokens": args.tokens, "configs": CONFIGS, "median": med,
           "head_speedup": {m: med["torch"]["head_ms"][m] / med["c++"]["head_ms"][m]
                            for m in med["c++"]["head_ms"]},
           "decode_speedup": {c: med["c++"]["decode_tokens_per_s"][c]
                              / med["torch"]["decode_tokens_per_s"][c]
                              for c in med["c++"]["decode_tokens_per_s"]},
           "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M")}
    from pdmesh.bench.report import save

    path = save(res, args.out, f"int8_head_{res['cpu']}", plot)
    log(f"head speedup {res['head_speedup']}; decode speedup {res['decode_speedup']}; "
        f"{path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
