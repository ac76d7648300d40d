"""The loop every engine-hosting service runs: while there is work, one step at a time,
its forward in the worker thread and the rest on this event loop (the engine's owner
thread, shared/engine/engine.py); hand the outputs to the service; sleep on `wake` when
idle.

A failing step never ends the loop: the service's on_failure decides what the requests in
hand get (an explicit error), and serving goes on."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

log = logging.getLogger("pdmesh.engine")


async def run_engine_loop(engine, executor: Executor, wake: asyncio.Event,
                          on_outputs: Callable[[list], Awaitable[None]],
                          on_failure: Callable[[Exception], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
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
        await on_outputs(outs)
        await asyncio.sleep(0)
