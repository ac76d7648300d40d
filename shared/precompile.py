"""A request's constraint compiled before the engine takes it: off the event loop, the
engine's owner thread (so heartbeats, every other handler and the steps keep running),
with a time limit.

    await precompile(engine, constraint)     # then engine.add_request / hold: a cache hit

The engine compiles a constraint when it builds the request (LLMEngine._new_seq, on
its owner thread); doing it here first leaves that a lookup in the
GrammarCompiler's cache. A constraint that cannot be served raises ConstraintError (a
ValueError), one that takes longer than timeout_s a ValueError: both become the
service's INVALID_REQUEST. The gateway already refused what it could not compile within
its own, shorter limit (services/gateway/grammar_check.py); this is the backstop for a
peer that skipped it. xgrammar cannot be interrupted: a compile past the limit finishes
on its thread (at most WORKERS at a time).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from shared.contracts.constraint import ConstraintKind

WORKERS = 2
TIMEOUT_S = 30.0
_pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="grammar")
_init = threading.Lock()


def _compile(engine, constraint) -> None:
    with _init:                  # the engine builds its compiler on first use: once
        compiler = engine.grammar
    compiler.compile(constraint)


def compiles(engine, constraint) -> bool:
    """Whether precompile() has work to do (it waits on a compile thread), or returns at
    once."""
    return not (constraint is None or ConstraintKind(constraint.kind) is ConstraintKind.NONE
                or engine.tokenizer is None)


async def precompile(engine, constraint, timeout_s: float = TIMEOUT_S) -> None:
    if not compiles(engine, constraint):
        return
    fut = asyncio.get_running_loop().run_in_executor(_pool, _compile, engine, constraint)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except asyncio.TimeoutError:
        raise ValueError(f"schema too complex: compiling it for constrained decoding took "
                         f"longer than {timeout_s:g}s") from None
