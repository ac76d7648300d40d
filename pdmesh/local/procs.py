"""Child processes for pdmesh up: each in its own session, dying with the thread that
spawned it (PR_SET_PDEATHSIG), its output kept and streamed as `[name] line`; and the
supervisor thread that does all the spawning, so that thread outlives every child.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pdmesh.local.forks import Forked, ForkServer
from pdmesh.local.zygote import signal_group

LOG_LINES = 400

# ---- child processes ---------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the spawning thread dies. Runs between fork and
    exec, so it only calls what is already loaded."""
    sig = int(signal.SIGKILL)

    def setup() -> None:
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent_pid:   # parent died before prctl took effect
                os._exit(1)
    return setup


class Proc:
    """One child process: its argv, its output (last LOG_LINES lines), its fate."""

    def __init__(self, name: str, service: str, argv: list[str], env: dict[str, str],
                 instance_id: str = "", pass_fds: tuple[int, ...] = ()):
        self.name, self.service, self.argv, self.env = name, service, argv, env
        self.pass_fds = pass_fds       # inherited file descriptors (the gateway's socket)
        self.instance_id = instance_id
        self.lines: deque[str] = deque(maxlen=LOG_LINES)
        self.popen: subprocess.Popen | Forked | None = None
        self.forks: ForkServer | None = None   # fork from here when it can (imports done)
        self.expected_exit = False     # set by stop/kill/restart: not a crash
        self.starts = 0
        self.crashes: list[int | None] = []   # exit codes of every exit nobody asked for
        self.restarting = False        # the supervisor will start it again
        self._reader: threading.Thread | None = None

    def spawn(self, echo: Callable[[str], None] | None, log_dir: Path | None) -> None:
        self.expected_exit = self.restarting = False
        self.starts += 1
        forked = self.forks.spawn(self.argv, self.env, self.pass_fds) if self.forks else None
        self.popen = forked or subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=self.pass_fds,
            preexec_fn=die_with_parent(os.getpid()))
        log_file = (log_dir / f"{self.name}.log").open("a") if log_dir else None
        self._reader = threading.Thread(target=self._read, args=(self.popen, echo, log_file),
                                        name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _read(self, popen: subprocess.Popen, echo, log_file) -> None:
        prefix = f"[{self.name}] "
        try:
            for raw in popen.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.lines.append(line)
                if echo is not None:
                    echo(prefix + line)
                if log_file is not None:
                    log_file.write(line + "\n")
                    log_file.flush()
        finally:
            popen.stdout.close()
            if log_file is not None:
                log_file.close()

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def crashed(self) -> bool:
        """Dead, and nobody asked it to stop."""
        return self.popen is not None and not self.alive and not self.expected_exit

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def signal(self, sig: int, group: bool = False) -> None:
        if self.popen is None:
            return
        if group:
            signal_group(self.popen.pid, sig)    # start_new_session: pgid == pid
        else:
            self.popen.send_signal(sig)          # a no-op once it has exited

    async def terminate(self, timeout_s: float) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group (grandchildren too)."""
        self.expected_exit, self.restarting = True, False
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.signal(signal.SIGKILL, group=True)
        while self.alive:
            await asyncio.sleep(0.02)
        if self._reader is not None:
            self._reader.join(timeout=2)

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])


# ---- the supervisor thread ----------------------------------------------------------------
class Supervisor:
    """A thread with its own event loop: every spawn and async check runs here."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="pdmesh-cluster", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine) -> Any:
        """coro run on this loop, awaited from another loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def call(self, coro: Coroutine) -> Any:
        fut = self.submit(coro)
        try:
            return fut.result()
        except BaseException:     # KeyboardInterrupt while waiting: stop the coroutine too
            fut.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


def on_loop(work: Callable[..., Coroutine], name: str = ""
            ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """From one coroutine method, run on its object's supervisor (self._sup) loop: the
    method that blocks until it is done (restart) and the one that awaits it (arestart);
    name: the blocking one's (else work's, less its leading underscore)."""
    name = name or work.__name__.lstrip("_")

    @functools.wraps(work)
    def blocking(self, *args, **kwargs):
        return self._sup.call(work(self, *args, **kwargs))

    @functools.wraps(work)
    async def awaited(self, *args, **kwargs):
        return await self._sup.run(work(self, *args, **kwargs))

    for fn, fn_name in ((blocking, name), (awaited, "a" + name)):
        fn.__name__ = fn_name
        fn.__qualname__ = work.__qualname__.rsplit(".", 1)[0] + "." + fn_name
    return blocking, awaited
