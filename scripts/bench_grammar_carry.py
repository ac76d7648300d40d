"""Compile a grammar where it is used, or carry the compiled one? One run, SmolLM2's
vocabulary: for constraints of growing size, xgrammar's compile time against serializing
the compiled grammar (once, where it was compiled), its size on the wire, and
deserializing it (at every engine that would receive it).

Each engine (prefill, decode) compiles a constraint once and keeps it in its LRU
(shared/engine/grammar/compiler.py), so carrying a compiled grammar pays off only where
deserializing costs less than compiling.

    python scripts/bench_grammar_carry.py [--out docs/bench]

Writes <out>/grammar_carry.json and <out>/grammar_carry.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import xgrammar as xgr

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.engine.gguf_convert import convert, default_model_dir
from shared.engine.grammar.build import build_grammar
from shared.engine.tokenizer import Tokenizer


def tools(n: int) -> str:
    """n tools of 4 typed properties each (a schema the gateway accepts)."""
    return json.dumps([{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "string", "maxLength": 32}, "b": {"type": "integer"},
            "c": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "d": {"type": "string", "enum": ["x", "y", "z"]}}}}} for i in range(n)])


def timed(fn, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench")
    a = ap.parse_args()
    tok = Tokenizer.from_pretrained(convert(default_model_dir()))
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=49152)
    rows = []
    for n in (1, 4, 16, 64):
        g = build_grammar(Constraint(kind=ConstraintKind.TOOLS_REQUIRED, tools=tools(n)))
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_grammar(g)
        wire = compiled.serialize_json()
        row = {"tools": n,
               "compile_s": timed(lambda: compiler.compile_grammar(g)),
               "serialize_s": timed(compiled.serialize_json),
               "deserialize_s": timed(lambda: xgr.CompiledGrammar.deserialize_json(wire, info)),
               "wire_bytes": len(wire)}
        rows.append(row)
        print(f"[grammar_carry] {n:3d} tools: compile {row['compile_s'] * 1e3:7.1f} ms, "
              f"deserialize {row['deserialize_s'] * 1e3:7.1f} ms, "
              f"{row['wire_bytes'] / 1e6:.2f} MB", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_carry.json").write_text(json.dumps({"vocab": 49152, "rows": rows},
                                                       indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["tools"] for r in rows]
    for k, label in (("compile_s", "compile where used"), ("deserialize_s", "deserialize carried"),
                     ("serialize_s", "serialize once")):
        ax.plot(xs, [r[k] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("tools in the constraint (tool_choice required)")
    ax.set_ylabel("ms")
    ax.set_title("xgrammar, SmolLM2 vocabulary: compile vs carry")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grammar_carry.png")
    print(f"[grammar_carry] wrote {out / 'grammar_carry.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
