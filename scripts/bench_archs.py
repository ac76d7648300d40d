"""Decode tokens/s per architecture at the bundled model's size, c=1 and c=16, one run.

Each architecture the engine serves is a random checkpoint (seeded, written by
transformers' own class) with SmolLM2-135M's shape where the architecture allows it
(vocab 49,152, hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1,536; Qwen3-MoE: 8
experts of 768 with 2 routed, so its active MLP is the dense one's), served by the engine
as `pdmesh serve` does (bfloat16, int4, default threads). Measured: decode tokens/s of one
request and of 16 together (64 new tokens each after a 32-token prompt), and for the MoE,
the weight bytes one decode step touches (every linear weight the forward reads, found by
wrapping it) against the active parameters' bytes; for architectures with sliding-window
or soft-capped layers, the same rates with those layers' decode rows attended one by one
(the path before batching them, masked_attention.attend_decode), side by side.

    python scripts/bench_archs.py [--out docs/bench] [--archs llama,gemma2] [--tokens 64]

Writes <out>/archs.json and <out>/archs.png.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
             max_position_embeddings=8192, tie_word_embeddings=True)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "mistral_window": ("MistralConfig", dict(sliding_window=64)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "glm4": ("Glm4Config", dict(pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(sliding_window=64, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=64, pad_token_id=0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=768, norm_topk_prob=True)),
}


def log(msg: str) -> None:
    print(f"[bench_archs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def checkpoint(path: Path, cls: str, fields: dict) -> Path:
    import transformers

    cfg = getattr(transformers, cls)(**(SHAPE | fields))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def decode_rate(eng, n_req: int, tokens: int) -> float:
    from shared.contracts.sampling import SamplingParams

    g = torch.Generator().manual_seed(n_req)
    prompts = [torch.randint(3, 49000, (32,), generator=g).tolist() for _ in range(n_req)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    started: set[str] = set()
    while len(started) < n_req:          # prefills first: each request's first token
        started |= {o.request_id for o in eng.step()}
    t0, done = time.perf_counter(), 0
    while eng.has_unfinished:
        done += sum(len(o.new_token_ids) for o in eng.step())
    return done / (time.perf_counter() - t0)


def touched_bytes(eng) -> dict:
    """Weight bytes one decode step of one request reads, against the active parameters'."""
    import shared.engine.model as M
    from shared.engine.quant import weight_nbytes

    seen: dict[int, int] = {}
    real = M.linear

    def spy(x, w, b=None):
        seen[id(w)] = weight_nbytes(w)
        return real(x, w, b)

    M.linear = spy
    try:
        meta, kv = M.one_prompt(eng.model_cfg, 1, eng.model.dtype)
        eng.model.forward(torch.tensor([7]), meta, kv)
    finally:
        M.linear = real
    read = sum(seen.values())
    active = eng.model.weight_bytes - weight_nbytes(eng.model.norm) - sum(
        weight_nbytes(t) for L in eng.model.layers for t in (L.ln1, L.ln2, L.post_attn,
                                                             L.post_mlp, L.q_norm, L.k_norm))
    return {"read_bytes_per_token": read, "active_bytes": active, "ratio": read / active}


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["archs"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = range(len(names))
    for k, (c, color) in enumerate((("c1", "tab:blue"), ("c16", "tab:orange"))):
        ax.bar([x + 0.4 * k for x in xs], [res["archs"][n][c] for n in names], 0.4,
               label=f"{c[1:]} request(s)", color=color)
    rw = [(x, res["archs"][n]) for x, n in zip(xs, names) if "c16_rowwise" in res["archs"][n]]
    ax.scatter([x + 0.4 for x, _ in rw], [r["c16_rowwise"] for _, r in rw], color="black",
               marker="_", s=300, label="16, masked rows one by one (before)", zorder=3)
    ax.set_xticks([x + 0.2 for x in xs], names, rotation=20)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"pdmesh engine, SmolLM2-135M shape, {res['config']['dtype']} + "
                 f"{res['config']['quantize']}, {res['config']['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="int4")
    a = ap.parse_args()
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    res = {"config": {"shape": SHAPE, "tokens": a.tokens, "dtype": a.dtype,
                      "quantize": a.quantize, "threads": torch.get_num_threads(),
                      "prompt_tokens": 32}, "archs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.archs.split(","):
            cls, fields = ARCHS[name]
            log(f"{name}: writing a random {cls} checkpoint")
            path = checkpoint(Path(tmp) / name, cls, fields)
            eng = LLMEngine(EngineConfig(model=str(path), dtype=a.dtype, quantize=a.quantize,
                                         num_blocks=1024, block_size=16, max_num_seqs=16),
                            tokenizer=None)
            row = {"c1": decode_rate(eng, 1, a.tokens), "c16": decode_rate(eng, 16, a.tokens),
                   "weight_bytes_per_token": eng.model.weight_bytes}
            if any(L.window for L in eng.model.layers) or eng.model_cfg.attn_softcap:
                eng.model.attn.batched_decode = False     # before: masked decode rows one by one
                row["c1_rowwise"] = decode_rate(eng, 1, a.tokens)
                row["c16_rowwise"] = decode_rate(eng, 16, a.tokens)
                eng.model.attn.batched_decode = True
            if eng.model_cfg.moe_layers:
                row["moe"] = touched_bytes(eng)
            res["archs"][name] = row
            log(f"{name}: c=1 {row['c1']:.1f} tok/s, c=16 {row['c16']:.1f} tok/s"
                + (f" (rows one by one: {row['c1_rowwise']:.1f}, {row['c16_rowwise']:.1f})"
                   if "c16_rowwise" in row else "")
                + (f", MoE bytes read / active {row['moe']['ratio']:.3f}" if "moe" in row
                   else ""))
            del eng
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "archs.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out / "archs.png")
    log(f"wrote {out / 'archs.json'} and {out / 'archs.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
