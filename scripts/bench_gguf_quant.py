"""Serving a quantized GGUF: how far each served mode is from the file's own weights.

For each llama.cpp block type (Q4_0, Q4_1, Q8_0): the bundled SmolLM2's layer matrices
through that type (the `gguf` package's quantize and dequantize, what llama-quantize and
pdmesh's conversion do), then, on held-out prose and code, perplexity, top-1 agreement and
KL against the file's weights served unquantized, for: int4 (each group on the better of
the Q4_0 and Q4_1 grids, shared/engine/quant.py), int4 on the min-to-max grid only (what
the engine did before), and int8 (per channel). `auto` marks what `--quantization auto`
serves for that file. The bundled weights are themselves Q4_1's: int4 re-finds them
wherever a type keeps their grid (Q4_1, and Q8_0, whose finer steps land near it, so int4
even beats int8 there); the Q4_0 column is a user's file, where the grid decides. auto
serves Q8_0 files at int8 on principle (an 8-bit file of weights that were never 4-bit
loses more at 4 bits), which this model cannot show.

    python scripts/bench_gguf_quant.py [--types Q4_0,Q4_1,Q8_0] [--text-tokens 4096]

Writes docs/bench/gguf_quant.json and .png.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pdmesh.bench.quality import held_out_texts, text_metrics
from pdmesh.bench.report import save
from shared.engine import quant
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.gguf_convert import default_model_dir
from shared.engine.gguf_header import engine_quantization

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[gguf_quant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def min_max_codes(w: torch.Tensor, group: int = quant.INT4_GROUP):
    """The int4 grid before each group chose: min to max in 15 steps, always."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15.0
    q = torch.round((g - lo) / scale).clamp_(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, lo + 8.0 * scale


def through(src: Path, qtype: str, out: Path) -> Path:
    """src's layer matrices stored as qtype and read back (bfloat16, as converted)."""
    import gguf
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    w = load_file(src / "model.safetensors")
    t = getattr(gguf.GGMLQuantizationType, qtype)
    for name, x in w.items():
        if x.dim() == 2 and "layers" in name:
            a = x.float().numpy()
            back = gguf.quants.dequantize(gguf.quants.quantize(a, t), t).reshape(a.shape)
            w[name] = torch.from_numpy(back).to(torch.bfloat16)
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


def engines_for(folder: Path) -> dict[str, LLMEngine]:
    base = dict(model=str(folder), dtype="bfloat16", num_blocks=256,
                max_num_batched_tokens=512, chunk_size=512)
    out = {"file": LLMEngine(EngineConfig(**base))}
    tok = out["file"].tokenizer
    out["int4"] = LLMEngine(EngineConfig(**base, quantize="int4"), tokenizer=tok)
    best = quant.int4_codes
    quant.int4_codes = min_max_codes
    try:
        out["int4 min-max only"] = LLMEngine(EngineConfig(**base, quantize="int4"),
                                             tokenizer=tok)
    finally:
        quant.int4_codes = best
    out["int8"] = LLMEngine(EngineConfig(**base, quantize="int8"), tokenizer=tok)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    types = list(res["types"])
    modes = [m for m in res["types"][types[0]]["text"]["prose"] if m != "file"]
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for a, text in zip(ax, ("prose", "code")):
        for i, m in enumerate(modes):
            vals = [100 * (res["types"][t]["text"][text][m]["perplexity"]
                           / res["types"][t]["text"][text]["file"]["perplexity"] - 1)
                    for t in types]
            a.bar([x + 0.27 * i for x in range(len(types))], vals, 0.27, label=m)
        a.set_xticks([x + 0.27 for x in range(len(types))],
                     [f"{t} (auto: {res['types'][t]['auto'] or 'none'})" for t in types])
        a.axhline(0, c="k", lw=0.8)
        a.set_ylabel(f"{text} perplexity vs the file's weights (%)")
        a.legend(fontsize=8)
    fig.suptitle(f"{res['model']} through each GGUF type, served by each engine mode "
                 f"({res['text_tokens']} held-out tokens per text, one run)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0")
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"model": Path(a.model).name, "text_tokens": a.text_tokens, "types": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in a.types.split(","):
            log(f"{qtype}: layer matrices through {qtype}")
            engines = engines_for(through(Path(a.model), qtype, Path(tmp) / qtype))
            tok = engines["file"].tokenizer
            text = {}
            for name, body in held_out_texts().items():
                ids = tok.encode(body)[:a.text_tokens]
                text[name] = text_metrics(engines, ids, a.window)
                log(f"{qtype} {name}: " + json.dumps(
                    {m: round(v["perplexity"], 3) for m, v in text[name].items()}))
            res["types"][qtype] = {"auto": engine_quantization({qtype: 1}), "text": text}
            del engines
    path = save(res, a.out, "gguf_quant", plot)
    log(f"wrote {path}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
