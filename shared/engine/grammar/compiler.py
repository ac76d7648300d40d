"""Constraint -> compiled grammar for one tokenizer, behind an LRU cache.

    compiler = GrammarCompiler(tokenizer, vocab_size=model_embedding_rows)
    state = compiler.new_state(constraint)     # None when the constraint is kind none
    compiler.stats()                           # hits, misses, compile seconds (for /metrics)

Special tokens: xgrammar matches every vocabulary entry by its text and only treats entries
with no text (padding rows) as unmatchable. So `<tool_call>` as one added token is allowed
wherever its text is — grammars need no token-level tags and work the same when the tag is
several plain-text tokens (SmolLM2). The flip side is that control tokens (`<|im_start|>`,
`<filename>`, ...) would be allowed inside JSON strings and free text; their text is blanked
in the TokenizerInfo so the grammar never allows them. The tool-call tags are never blanked,
even in a vocabulary that marks them special. Stop tokens are passed by id and allowed
exactly where the grammar may end.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xgrammar as xgr

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.engine.tokenizer import Tokenizer

from .build import TOOL_CALL_END, TOOL_CALL_START, ConstraintError, build_grammar, xgrammar_message
from .state import ConstraintState, ReplayError

TEXT_TAGS = frozenset({TOOL_CALL_START, TOOL_CALL_END})


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int
    misses: int
    compile_seconds: float     # total spent compiling (misses only)
    size: int                  # grammars held now

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    constraint: Constraint
    grammar: xgr.CompiledGrammar
    vocab_size: int                  # mask width: the model's logits rows
    stop_token_ids: tuple[int, ...]

    def new_state(self) -> ConstraintState:
        return ConstraintState(self.grammar, self.vocab_size, self.stop_token_ids)


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe, compiles outside the lock."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, *,
                 cache_size: int = 256, max_threads: int | None = None):
        self.fingerprint = tokenizer.fingerprint
        # the model's embedding rows: logits (and so masks) may be wider than the tokenizer
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self.stop_token_ids = tuple(sorted(tokenizer.eos_token_ids))
        if not self.stop_token_ids:
            raise ValueError("a grammar needs at least one stop token; the tokenizer has no EOS")
        self.info = tokenizer_info(tokenizer.hf, self.vocab_size, self.stop_token_ids)
        threads = max_threads or min(8, os.cpu_count() or 1)
        # our LRU is the only cache: bounded, and its counters are the truth
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, Constraint], CompiledConstraint] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._compile_seconds = 0.0

    def compile(self, constraint: Constraint) -> CompiledConstraint | None:
        """None for kind none; raises ConstraintError when the constraint cannot be served."""
        if ConstraintKind(constraint.kind) is ConstraintKind.NONE:
            return None
        key = (self.fingerprint, constraint)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return hit
        t0 = time.perf_counter()
        grammar = build_grammar(constraint)
        try:
            compiled = self._xgr.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise ConstraintError(f"grammar cannot be compiled: {xgrammar_message(e)}") from None
        entry = CompiledConstraint(constraint, compiled, self.vocab_size, self.stop_token_ids)
        with self._lock:
            self._misses += 1
            self._compile_seconds += time.perf_counter() - t0
            self._cache[key] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return entry

    def new_state(self, constraint: Constraint, replay: Sequence[int] = ()
                  ) -> ConstraintState | None:
        """A matcher at the start of the constraint, or past `replay` (output generated
        under it elsewhere: a migrated request); ValueError when replay breaks it."""
        compiled = self.compile(constraint)
        state = compiled.new_state() if compiled is not None else None
        if state is not None and replay:
            try:
                state.replay(list(replay))
            except ReplayError as e:
                raise ValueError(f"the output to resume from breaks the constraint: {e}") from e
        return state

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._compile_seconds, len(self._cache))


def tokenizer_info(hf, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with control special tokens made unmatchable."""
    detected = xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    encoded = [""] * vocab_size                        # ids past the tokenizer: padding rows
    for token, idx in hf.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in hf.added_tokens_decoder.items():
        if added.special and added.content not in TEXT_TAGS and idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids),
                             add_prefix_space=detected.add_prefix_space)
