"""The loop every engine-hosting service runs: step the engine in its worker thread while
there is work, hand the outputs to the service, sleep on `wake` when idle.

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
        if not engine.has_unfinished:
            wake.clear()
            await wake.wait()
            continue
        try:
            outs = await loop.run_in_executor(executor, engine.step)
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed")
            await on_failure(e)
            continue
        await on_outputs(outs)
        await asyncio.sleep(0)
