"""Constrained decoding (tool calls, JSON) with xgrammar.

Life cycle of a constraint:

1. gateway: `build_grammar(constraint)` refuses what cannot be served (ConstraintError -> 400);
   the `Constraint` itself (kind + canonical schema/tools text) travels in every hand-off.
2. prefill: `compiler.new_state(constraint)`; the first token is sampled under `state.mask()`.
3. decode: a fresh state from its own compiler, `state.replay(output_ids)` (ReplayError means
   the two sides disagree: refuse, never guess), then mask -> sample -> accept per token, or
   `masks_for(drafts)` -> verify -> accept_many for speculative steps.

Each process compiles a constraint once and reuses it by key (compiler.py's LRU); the
constraint's text crosses, not its compiled grammar: deserializing a carried one costs as
much as compiling it or more (SmolLM2's vocabulary: 1 tool 9.6 vs 6.2 ms, 4 tools 8.8 vs
8.8 ms, 16 tools 14.6 vs 20.8 ms and 0.94 MB, 64 tools 22.6 vs 112.5 ms and 7.2 MB;
scripts/bench_grammar_carry.py, docs/bench/grammar_carry.json).

build.py    Constraint -> xgrammar Grammar (tokenizer-independent, validation)
compiler.py GrammarCompiler: Grammar -> CompiledGrammar for one vocabulary, LRU + counters
state.py    ConstraintState: per-request matcher, masks, accept / rollback / replay
"""
from .build import TOOL_CALL_END, TOOL_CALL_START, ConstraintError, build_grammar, tool_parameters
from .compiler import CacheStats, CompiledConstraint, GrammarCompiler
from .state import ConstraintState, ReplayError

__all__ = [
    "TOOL_CALL_END", "TOOL_CALL_START", "CacheStats", "CompiledConstraint", "ConstraintError",
    "ConstraintState", "GrammarCompiler", "ReplayError", "build_grammar", "tool_parameters",
]
