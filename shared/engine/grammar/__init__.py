"""Constrained decoding (tool calls, JSON) with xgrammar.

Life cycle of a constraint:

1. gateway: `build_grammar(constraint)` refuses what cannot be served (ConstraintError -> 400);
   the `Constraint` itself (kind + canonical schema/tools text) travels in every hand-off.
2. prefill: `compiler.new_state(constraint)`; the first token is sampled under `state.mask()`.
3. decode: a fresh state from its own compiler, `state.replay(output_ids)` (ReplayError means
   the two sides disagree: refuse, never guess), then mask -> sample -> accept per token, or
   `masks_for(drafts)` -> verify -> accept_many for speculative steps.

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
