"""The supervisor's watch: a child of `pdmesh up` that exits without being asked to is started
again with the same argv, environment and instance id (a new incarnation: decode's epochs and
owner checks fence off its previous life), after the backoff pdmesh.local.restarts decides; a child
that crash-loops makes the watch give up, and `pdmesh up` then stops the mesh saying why.

Runs as a task on the cluster's supervisor loop (pdmesh.local.procs.Supervisor), the thread that
spawns every child, so a restarted child still dies with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from pdmesh.local.procs import Proc
from pdmesh.local.restarts import GiveUp, RestartPolicy


class Watchdog:
    def __init__(self, procs: dict[str, Proc], policy: RestartPolicy,
                 emit: Callable[[str], None], log_dir: Path | None,
                 on_start: Callable[[Proc], None] | None = None, interval_s: float = 0.2):
        """procs: the cluster's children by name (read live: added ones are watched too).
        on_start: called after a child was started again (the run record's pids)."""
        self.procs, self.policy, self.emit, self.log_dir = procs, policy, emit, log_dir
        self.on_start, self.interval_s = on_start, interval_s
        self.gave_up: str | None = None          # why, once a child crash-looped
        self._pending: set[asyncio.Task] = set()

    async def run(self) -> None:
        try:
            while self.gave_up is None:
                for p in list(self.procs.values()):
                    if p.crashed and not p.restarting:
                        self._exited(p)
                await asyncio.sleep(self.interval_s)
        finally:
            for t in self._pending:
                t.cancel()

    def _exited(self, p: Proc) -> None:
        code = p.returncode
        p.crashes.append(code)
        decision = self.policy.on_exit(p.name, time.monotonic())
        if isinstance(decision, GiveUp):
            self.gave_up = (f"{decision.reason}; last exit code {code}; its last lines:\n"
                            f"{p.tail(20)}")
            self.emit(f"[pdmesh] giving up: {decision.reason}")
            return
        p.restarting = True
        self.emit(f"[pdmesh] {p.name} exited with code {code}; starting it again in "
                  f"{decision.delay_s:g} s (exit {decision.attempt} of at most "
                  f"{self.policy.limit - 1} within {self.policy.window_s:g} s); its last "
                  f"lines:\n" + "\n".join(f"[pdmesh]   {line}" for line in p.tail(10).splitlines()))
        task = asyncio.ensure_future(self._start_again(p, decision.delay_s))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _start_again(self, p: Proc, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if not p.restarting:          # stopped or started by someone else meanwhile
            return
        p.spawn(self.emit, self.log_dir)
        self.emit(f"[pdmesh] {p.name} started again (pid {p.pid})")
        if self.on_start is not None:
            self.on_start(p)
