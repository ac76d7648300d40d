"""Tools and JSON schemas compiled for constrained decoding before a request is sent,
off the event loop and the parse thread, with a time limit.

    guard = GrammarGuard(model_dir, vocab_size, timeout_s=5.0)
    await guard.check(pending)      # structured.deferred_checks() collected them

Each check builds the grammar and compiles it against the model's vocabulary (the work
decode and prefill will do), in one of `workers` threads (xgrammar releases the GIL while
it works). A check that has not finished within timeout_s is a 400 `schema_too_complex`,
and that verdict is remembered by the constraint's digest, so the same schema is refused
at once next time. xgrammar cannot be interrupted: a compile past the limit finishes in
its thread, so at most `workers` of them run at a time, and a check still waiting for a
free thread at its limit is a 429 (retry), not a verdict on its schema.
Verdicts are cached by digest (structured.remember), never the schema text.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .protocol import overloaded
from .structured import (
    TOO_COMPLEX,
    GrammarCheck,
    grammar_error,
    grammar_problem,
    remember,
    verdict,
)

log = logging.getLogger("pdmesh.gateway")


class GrammarGuard:
    def __init__(self, model_dir: str, vocab_size: int, timeout_s: float, workers: int = 4):
        self.model_dir, self.vocab_size, self.timeout_s = model_dir, vocab_size, timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gateway-grammar")
        self._compiler = None
        self._compiler_failed = False
        self._lock = threading.Lock()
        self.counts = {"compiled": 0, "refused": 0, "too_complex": 0, "busy": 0}

    def _compile_fn(self):
        """The vocabulary's GrammarCompiler (built once), or None: build-only checks (a
        model folder without a tokenizer)."""
        with self._lock:
            if self._compiler is None and not self._compiler_failed:
                try:
                    from shared.engine.grammar import GrammarCompiler
                    from shared.engine.tokenizer import Tokenizer
                    tok = Tokenizer.from_pretrained(self.model_dir)
                    self._compiler = GrammarCompiler(tok, vocab_size=self.vocab_size,
                                                     cache_size=0, max_threads=1)
                except Exception as e:  # noqa: BLE001 - the build-only check still runs
                    log.warning("grammar checks without a vocabulary: %s", type(e).__name__)
                    self._compiler_failed = True
            return self._compiler.compile if self._compiler is not None else None

    async def warm(self) -> None:
        """Build the compiler now (in a worker), not on the first constrained request."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._compile_fn)

    async def check(self, pending: list[GrammarCheck]) -> None:
        """Raise the first check's 400 (or a 429 when no worker was free in time)."""
        for c in pending:
            problem = verdict(c.key)
            if problem is False:
                problem = await self._run(c)
            if problem is not None:
                raise grammar_error(c, problem)

    async def _run(self, c: GrammarCheck) -> str | None:
        started: list[float] = []

        def work() -> str | None:
            started.append(time.monotonic())
            return grammar_problem(c.constraint, self._compile_fn())

        fut = asyncio.get_running_loop().run_in_executor(self._pool, work)
        try:
            problem = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            if not started:
                self.counts["busy"] += 1
                fut.cancel()                   # never started: nothing runs for it
                raise overloaded("constrained-decoding compilers are busy") from None
            self.counts["too_complex"] += 1
            problem = (f"{TOO_COMPLEX}: compiling it for constrained decoding took "
                       f"longer than {self.timeout_s:g}s")
            remember(c.key, problem)
            raise grammar_error(c, problem) from None
        self.counts["refused" if problem else "compiled"] += 1
        remember(c.key, problem)
        return problem

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def deferred(fn, *args):
    """fn(*args) on this thread with its grammar checks collected: (result, pending)."""
    from .structured import deferred_checks
    with deferred_checks() as pending:
        return fn(*args), pending

