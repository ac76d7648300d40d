"""The loop every engine-hosting service runs: while there is work, one step at a time,
its forward in the worker thread and the rest on this event loop (the engine's owner
thread, shared/engine/engine.py); hand the outputs to the service; sleep on `wake` when
idle.

A failing step never ends the loop: the service's on_failure decides what the requests in
hand get (an explicit error), and serving goes on.

While it serves, one line every PDMESH_LOG_STATS_S seconds (default 10; 0: none), as
vLLM's: running and waiting requests, prompt and generation tokens/s, KV blocks in use
(logger pdmesh.engine.stats; JSON fields with PDMESH_LOG_FORMAT=json)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

log = logging.getLogger("pdmesh.engine")
stats_log = logging.getLogger("pdmesh.engine.stats")


class Throughput:
    """What the engine did since the last line; line() says it once `every_s` passed and
    there was something to say, or (idle: the engine ran out of work) at once, so the last
    burst before a quiet spell is reported too."""

    def __init__(self, engine, every_s: float, clock=time.monotonic):
        self.engine, self.every_s, self.clock = engine, every_s, clock
        self.t0, self.generated = clock(), 0
        self.prompt0 = engine.counters.get("prompt_tokens", 0)

    def add(self, outs: list) -> None:
        self.generated += sum(len(o.new_token_ids) for o in outs)

    def line(self, idle: bool = False) -> dict | None:
        now = self.clock()
        dt = now - self.t0
        if self.every_s <= 0 or dt <= 0 or (dt < self.every_s and not idle):
            return None
        st = self.engine.stats()
        prompt = st.get("prompt_tokens", 0) - self.prompt0
        busy = st["running"] or st["waiting"] or self.generated or prompt
        out = {"running": st["running"], "waiting": st["waiting"],
               "prompt_tok_s": round(prompt / dt, 1),
               "generation_tok_s": round(self.generated / dt, 1),
               "kv_usage": round(st["blocks_used"] / max(1, st["blocks_total"]), 3)}
        self.t0, self.generated, self.prompt0 = now, 0, st.get("prompt_tokens", 0)
        return out if busy else None

    def maybe_log(self, idle: bool = False) -> None:
        if (f := self.line(idle)) is not None:
            stats_log.info("%d running, %d waiting, prompt %.1f tok/s, generation %.1f tok/s, "
                           "KV %.1f%% used", f["running"], f["waiting"], f["prompt_tok_s"],
                           f["generation_tok_s"], 100 * f["kv_usage"], extra={"fields": f})


def stats_every_s() -> float:
    try:
        return float(os.environ.get("PDMESH_LOG_STATS_S", "10"))
    except ValueError:
        return 10.0


async def run_engine_loop(engine, executor: Executor, wake: asyncio.Event,
                          on_outputs: Callable[[list], Awaitable[None]],
                          on_failure: Callable[[Exception], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    tp = Throughput(engine, stats_every_s())
    while True:
        tp.maybe_log()
        try:
            plan = engine.begin_step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed")
            await on_failure(e)
            continue
        if plan is None:
            if engine.has_unfinished:      # waiting for blocks: someone frees them
                await asyncio.sleep(0.001)
            else:
                tp.maybe_log(idle=True)
                wake.clear()
                await wake.wait()
            continue
        try:
            logits = await loop.run_in_executor(executor, engine.forward, plan)
            outs = engine.end_step(plan, logits)
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed")
            engine.end_step(plan, None, failed=True)
            await on_failure(e)
            continue
        tp.add(outs)
        await on_outputs(outs)
        await asyncio.sleep(0)
