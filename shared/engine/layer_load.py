"""Layer-wise KV loads and their readiness guard (the CPU analogue of a CUDA event per
layer on a load stream).

A prefix hit in a lower tier (kvstore's host memory or disk) is copied into engine
blocks layer by layer while the engine already computes the rest of the prompt. Compute
on layer i reads those blocks only after `wait(i)` returned, i.e. after layer i's copy
completed: a read before ready would attend over stale bytes, which is exactly the
garbled-output bug this guard exists for. The loader (an asyncio task, or LayerSplit's
worker thread) copies through `land()` and calls `layer_done(i)` after layer i, or
`fail()`; the forward waits.

The load is also the one fence between its loader and the engine's owner: `cancel()`
(the request went away, its blocks are about to be freed) and `land()` take the load's
own lock, so once cancel() returned no copy is in progress and none will start.
"""
from __future__ import annotations

import threading
import time


class LoadFailed(RuntimeError):
    """A layer load did not complete (checksum mismatch, tier gone, timeout)."""


class LayerLoad:
    def __init__(self, request_id: str, num_layers: int, blocks: list[int], keys: list[bytes],
                 first_block: int):
        self.request_id = request_id
        self.blocks = blocks             # engine blocks the load fills
        self.keys = keys                 # their prefix keys
        self.first_block = first_block   # index of blocks[0] in the request's block table
        self._ready = [threading.Event() for _ in range(num_layers)]
        self.error: str | None = None
        self.cancelled = False   # the request went away: the loader stops
        self._fence = threading.Lock()
        self.t0 = time.monotonic()
        self.arrived = [0.0] * num_layers     # seconds after t0 each layer became ready
        self.waits: list[tuple[int, float, float]] = []   # (layer, wait start, wait end)

    def land(self, copy) -> bool:
        """Run copy() (one layer's bytes into the load's blocks) unless the load was
        cancelled; whether it ran."""
        with self._fence:
            if self.cancelled:
                return False
            copy()
            return True

    def cancel(self) -> None:
        """The blocks are going away: after this returns no copy lands in them."""
        with self._fence:
            self.cancelled = True

    def layer_done(self, layer: int) -> None:
        self.arrived[layer] = time.monotonic() - self.t0
        self._ready[layer].set()

    def fail(self, reason: str) -> None:
        self.error = reason
        for e in self._ready:
            e.set()

    @property
    def complete(self) -> bool:
        return self.error is None and all(e.is_set() for e in self._ready)

    def wait(self, layer: int, timeout: float) -> None:
        """Block until layer `layer` is loaded; LoadFailed if the load failed or timed out."""
        t = time.monotonic()
        ok = self._ready[layer].wait(timeout)
        self.waits.append((layer, t - self.t0, time.monotonic() - self.t0))
        if not ok:
            self.fail(f"layer {layer} not loaded within {timeout}s")
        if self.error is not None:
            raise LoadFailed(f"{self.request_id}: {self.error}")

    def timeline(self) -> dict:
        return {"layers_ready_s": [round(a, 6) for a in self.arrived],
                "compute_waits_s": [(l, round(a, 6), round(b, 6)) for l, a, b in self.waits]}
