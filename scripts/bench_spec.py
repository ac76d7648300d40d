"""Speculative decoding benchmark: decode tokens/s with and without the draft, side by side.

  engines      the target alone, and target + draft at each k (--k 2 4: at most k drafts,
               chosen per step by shared/engine/spec/adapt.py; --limited 4: the same with
               spec_max_batch --max-batch (4: no draft above 4 decoding sequences);
               --fixed 4: always k)
  prompts      code (tests/conftest.py CODE_PROMPTS) and chat (synthetic multi-turn Q&A,
               rendered with the chat template): the draft agrees with the target on ~64%
               of code tokens and ~90% of chat tokens
  concurrency  1: each prompt runs alone on every engine in turn; above 1 (--concurrency,
               default 4 16): rounds of c requests at once, every engine in turn each round
               (interleaved, so machine load hits all engines alike)

Decode tokens/s counts the tokens of steps that finished no prefill, over those steps' time.
Acceptance from the engine's counters: accept length = (accepted + steps) / steps, the
mean tokens one verification emits (SGLang's spec_accept_length), and accept rate =
accepted / proposed. Non-deterministic mode, greedy, ignore_eos, one torch thread.
Writes docs/bench/spec_<model>.json and .png.

    python scripts/bench_spec.py [--k 2 4] [--max-tokens 128] [--prompts 8] [--rounds 3]
                                 [--concurrency 4 16]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pdmesh.bench.workloads import CODE_PROMPTS
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from synth_chat import plain_qa

ROOT = Path(__file__).resolve().parents[1]


SPEC = ("spec_steps", "spec_proposed", "spec_accepted")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_prompts(tok, n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(0, 2)):
            q, a = plain_qa(rng)
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(tok.encode_chat(turns + [{"role": "user", "content": plain_qa(rng)[0]}]))
    return out


def make_engine(args, k: int, adaptive: bool = True, max_batch: int = 0,
                method: str = "") -> LLMEngine:
    eng = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_blocks=2048, block_size=16, max_num_seqs=8,
        max_num_batched_tokens=512, chunk_size=512, threads=1, quantize=args.quantize,
        draft_model=args.draft if k and not method else "", spec_method=method,
        num_speculative_tokens=k, spec_adaptive=adaptive, spec_max_batch=max_batch))
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    return eng


class Tally:
    """Decode tokens and seconds, and spec counter deltas, over several runs."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0
        self.spec = dict.fromkeys(SPEC, 0)

    def run(self, eng: LLMEngine, prompts, max_tokens: int) -> None:
        before = {n: eng.counters[n] for n in SPEC}
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for j, ids in enumerate(prompts):
            eng.add_request(f"b{time.monotonic_ns()}-{j}", ids, p)
        while eng.has_unfinished:
            t = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t
            # a step that finished a prefill (a first token) is not a decode step
            if outs and all(o.num_output_tokens > len(o.new_token_ids) for o in outs):
                self.seconds += dt
                self.tokens += sum(len(o.new_token_ids) for o in outs)
        for n in SPEC:
            self.spec[n] += eng.counters[n] - before[n]

    def result(self) -> dict:
        s, prop, acc = (self.spec[n] for n in SPEC)
        return {"tokens_per_s": self.tokens / self.seconds, "decode_tokens": self.tokens,
                "decode_s": self.seconds, **self.spec,
                "accept_length": (acc + s) / s if s else None,
                "accept_rate": acc / prop if prop else None}


def bench(engines: dict, prompts, max_tokens: int, rounds: int, kind: str,
          levels: list[int]) -> dict:
    tallies = {c: {name: Tally() for name in engines} for c in [1, *levels]}
    for i, ids in enumerate(prompts):          # concurrency 1, interleaved prompt by prompt
        for name, eng in engines.items():
            tallies[1][name].run(eng, [ids], max_tokens)
        log(f"  {kind} c=1 prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{n} {t.tokens / t.seconds:.0f} tok/s" for n, t in tallies[1].items()))
    for c in levels:
        for r in range(rounds):                 # c requests at once, engines in turn each round
            batch = ((prompts[r:] + prompts[:r]) * c)[:c]
            for name, eng in engines.items():
                tallies[c][name].run(eng, batch, max_tokens)
            log(f"  {kind} c={c} round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {t.tokens / t.seconds:.0f} tok/s" for n, t in tallies[c].items()))
    out = {}
    for c, by_name in tallies.items():
        res = {name: t.result() for name, t in by_name.items()}
        base = res["plain"]["tokens_per_s"]
        for r in res.values():
            r["speedup"] = r["tokens_per_s"] / base
        out[str(c)] = res
    return out


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(res["runs"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        by_c = res["runs"][kind]
        names = list(by_c["1"])
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(by_c))]
            runs = [by_c[c][name] for c in by_c]
            bars = ax.bar(xs, [r["tokens_per_s"] for r in runs], width, label=name)
            labels = [f"{r['speedup']:.2f}x" + (f"\nL={r['accept_length']:.2f}"
                                                 if r["accept_length"] else "") for r in runs]
            ax.bar_label(bars, labels, fontsize=7)
        ax.set_xticks(range(len(by_c)), [f"concurrency {c}" for c in by_c])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{kind} prompts")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=.3)
    fig.suptitle(f"speculative decoding: {res['model']} + {res['draft']} ({res['dtype']}, "
                 f"{res['max_tokens']} tokens, greedy; L = mean accept length)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "tiny-draft"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens")
    ap.add_argument("--fixed", type=int, nargs="*", default=[4],
                    help="also these k without adaptation (spec_adaptive off): the old engine")
    ap.add_argument("--limited", type=int, nargs="*", default=[4],
                    help="also these k adaptive with spec_max_batch = --max-batch")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--ngram", type=int, nargs="*", default=[],
                    help="also these k with model-free n-gram drafts (spec_method ngram)")
    ap.add_argument("--ngram-limited", action="store_true",
                    help="also each --ngram k with spec_max_batch = --max-batch")
    ap.add_argument("--quantize", default="", help="the engines' weights: '' | int8 | int4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8, help="per kind at concurrency 1")
    ap.add_argument("--rounds", type=int, default=3, help="of c requests at each --concurrency")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4, 16],
                    help="levels above 1, each in rounds of that many requests at once")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    sets = {"code": [tok.encode(p) for p in CODE_PROMPTS[:args.prompts]],
            "chat": chat_prompts(tok, args.prompts)}
    drafted = args.draft != "none"
    engines = {"plain": make_engine(args, 0)}
    if drafted:
        engines |= {f"k={k}": make_engine(args, k) for k in args.k}
        engines |= {f"k={k} max_batch={args.max_batch}":
                    make_engine(args, k, max_batch=args.max_batch) for k in args.limited}
        engines |= {f"k={k} fixed": make_engine(args, k, adaptive=False) for k in args.fixed}
    engines |= {f"ngram k={k}": make_engine(args, k, method="ngram") for k in args.ngram}
    engines |= {f"ngram k={k} max_batch={args.max_batch}":
                make_engine(args, k, max_batch=args.max_batch, method="ngram")
                for k in args.ngram if args.ngram_limited}
    log(f"{Path(args.model).name} + {Path(args.draft).name}, {args.dtype}, threads "
        f"{torch.get_num_threads()}, engines {list(engines)}, {args.max_tokens} tokens")
    runs = {}
    for kind, prompts in sets.items():
        log(f"{kind}: {len(prompts)} prompts")
        runs[kind] = bench(engines, prompts, args.max_tokens, args.rounds, kind,
                           args.concurrency)
    res = {"model": Path(args.model).name, "draft": Path(args.draft).name if drafted else
           "ngram", "dtype": args.dtype, "quantize": args.quantize,
           "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
           "prompts_per_kind": args.prompts, "rounds": args.rounds,
           "concurrency": [1, *args.concurrency], "k": args.k,
           "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"spec_{res['model']}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot(res, out / f"{stem}.png")
    for kind, by_c in runs.items():
        for c, by_name in by_c.items():
            log(f"{kind} c={c}: " + ", ".join(
                f"{n} {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x"
                + (f", L={r['accept_length']:.2f}" if r["accept_length"] else "") + ")"
                for n, r in by_name.items()))
    log(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
