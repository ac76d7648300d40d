"""The launcher's side of the fork server (pdmesh.local.zygote): start it, ask it for
children, and hold each child as a Popen-like handle (pid, stdout, poll, send_signal) that
pdmesh.local.procs.Proc uses as it uses a Popen.

    forks = ForkServer(env)           # on the supervisor thread: the zygote dies with it
    forks.start()
    ...
    child = forks.spawn(argv, env, pass_fds)   # None: not forkable here, use Popen
    forks.close()                      # the zygote stops; its children are killed

    forks = shared(env, preexec_fn)    # what Cluster uses: one zygote for every mesh this
                                       # process starts with that environment

A child is forked only when the zygote is ready, the command is `python -m MODULE ...` of
this interpreter, its environment differs from the zygote's in PDMESH_* variables alone,
and its command line and environment fit the room the zygote reserved. If the zygote dies,
its children die with it (their supervisor starts them again) and the next spawn starts a
new zygote, using Popen meanwhile.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from pdmesh.local.zygote import MAX_MSG, ROOM_ENV, signal_group

ARGV_ROOM = 16384      # bytes reserved for a child's command line
ENV_ROOM = 32768       # and for its environment, beyond the zygote's own
REPLY_TIMEOUT_S = 10.0


# set anew for each test phase by pytest, and read by none of the zygote's imports
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def _own(env: dict[str, str]) -> dict[str, str]:
    """What must equal the zygote's: the environment its imports ran under, less pdmesh's
    own variables (read by the child, after the fork) and VOLATILE."""
    return {k: v for k, v in env.items() if not k.startswith("PDMESH_") and k not in VOLATILE}


class Forked:
    """A child forked by the zygote, as Proc sees a Popen."""

    def __init__(self, pid: int, stdout):
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:     # reaped by the zygote, its exit not yet read
                pass

    def exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()


class ForkServer:
    def __init__(self, env: dict[str, str], preexec_fn: Callable[[], None] | None = None,
                 start_timeout_s: float = 120.0,
                 keeper: concurrent.futures.Executor | None = None):
        """env: the zygote's environment (every child's but its PDMESH_* variables).
        preexec_fn: the zygote's (pdmesh.local.procs: die with the spawning thread).
        keeper: the thread that starts the zygote (else the caller's)."""
        self.env, self.preexec_fn, self.keeper = dict(env), preexec_fn, keeper
        self.start_timeout_s = start_timeout_s
        self.popen: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=200)    # the zygote's own output
        self.room: dict[str, int] | None = None       # set when ready
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._replied = threading.Condition(self._lock)
        self._children: dict[int, Forked] = {}
        self._early_exits: dict[int, int] = {}        # an exit seen before its pid reply

    # ---- life ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote (it imports for a few seconds; spawn() uses Popen until then)."""
        if self.keeper is not None:
            return self.keeper.submit(self._start).result()
        return self._start()

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = self.env | {ROOM_ENV: " " * ENV_ROOM}
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "pdmesh.local.zygote", "--fd", str(theirs.fileno()),
                 "--room", " " * ARGV_ROOM],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(theirs.fileno(),), preexec_fn=self.preexec_fn)
        finally:
            theirs.close()
        self._sock = mine
        self._reader = threading.Thread(target=self._read, args=(mine,),
                                        name="zygote-replies", daemon=True)
        self._reader.start()
        threading.Thread(target=self._log, args=(self.popen,), name="zygote-log",
                         daemon=True).start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(self.start_timeout_s if timeout_s is None else timeout_s)

    @property
    def has_children(self) -> bool:
        with self._lock:
            return bool(self._children)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def close(self) -> None:
        """Stop the zygote: it kills whatever children it still has, then exits."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)     # wakes the reader; EOF there
            except OSError:
                pass
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
            self.popen = None
        if self._reader is not None:
            self._reader.join(timeout=5)                  # its children are accounted for
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ---- children --------------------------------------------------------------------------
    def forkable(self, argv: list[str], env: dict[str, str]) -> bool:
        if not (self._ready.is_set() and self.alive and self.room is not None):
            return False
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3 or _own(env) != _own(self.env):
            return False
        argv_bytes = sum(len(a.encode()) + 1 for a in argv)
        env_bytes = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
        return argv_bytes < self.room["argv_room"] and env_bytes < self.room["env_room"]

    def spawn(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
              ) -> Forked | None:
        """A forked child running argv, or None when it cannot be forked here now (the
        caller uses Popen). Restarts a dead zygote for the next time."""
        if self.popen is not None and not self.alive:
            self.close()
            self.start()
            return None
        if not self.forkable(argv, env):
            return None
        r, w = os.pipe()
        try:
            with self._lock:
                self._next += 1
                rid = self._next
                msg = {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(),
                       "fds": list(pass_fds)}
                socket.send_fds(self._sock, [json.dumps(msg).encode()], [w, *pass_fds])
                deadline = time.monotonic() + REPLY_TIMEOUT_S
                while (rid not in self._replies and self._ready.is_set()
                       and time.monotonic() < deadline):
                    self._replied.wait(timeout=0.5)
                reply = self._replies.pop(rid, None)
        except OSError:
            reply = None
        finally:
            os.close(w)
        if reply is None or "pid" not in reply:
            os.close(r)
            if reply is None and self.alive:   # no answer: a stuck zygote, and whatever
                self.close()                   # it forked late dies with it
            return None
        child = Forked(reply["pid"], open(r, "rb"))
        with self._lock:
            self._children[child.pid] = child
            if child.pid in self._early_exits:
                child.exited(self._early_exits.pop(child.pid))
        return child

    # ---- the reader threads ----------------------------------------------------------------
    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                data = sock.recv(MAX_MSG)
                if not data:
                    break
                self._on(json.loads(data))
        except OSError:
            pass
        finally:
            self._gone()

    def _on(self, msg: dict) -> None:
        if "ready" in msg:
            self.room = msg["ready"]
            self._ready.set()
            return
        with self._lock:
            if "exit" in msg:
                child = self._children.pop(msg["exit"], None)
                if child is None:
                    self._early_exits[msg["exit"]] = msg["code"]
                else:
                    child.exited(msg["code"])
            else:
                self._replies[msg["id"]] = msg
                self._replied.notify_all()

    def _gone(self) -> None:
        """The zygote is gone: so are its children (PR_SET_PDEATHSIG), whose exits it can no
        longer report."""
        with self._lock:
            self._ready.clear()
            self._replied.notify_all()
            children, self._children = self._children, {}
        for child in children.values():
            signal_group(child.pid, signal.SIGKILL)
            child.exited(-int(signal.SIGKILL))

    def _log(self, popen: subprocess.Popen) -> None:
        for raw in popen.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
        popen.stdout.close()


# ---- one zygote for every mesh of this process ----------------------------------------------
_shared: dict[tuple, ForkServer] = {}
_shared_lock = threading.Lock()
# the zygote dies with the thread that started it (PR_SET_PDEATHSIG follows the thread), and
# a mesh's supervisor thread ends at its stop: a shared zygote is started (and restarted)
# by this executor's one thread, which lives as long as the process
_keeper: concurrent.futures.ThreadPoolExecutor | None = None


def shared(env: dict[str, str], preexec_fn: Callable[[], None] | None = None) -> ForkServer:
    """The zygote for env (less its PDMESH_* variables), started once and kept for every mesh
    this process starts (a test run starts dozens: each would import torch, transformers
    and the rest again, ~3.4 s). Meshes never close it; it stops when the process exits."""
    global _keeper
    key = tuple(sorted(_own(env).items()))
    with _shared_lock:
        forks = _shared.get(key)
        if forks is None:
            if _keeper is None:
                _keeper = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="zygote-keeper")
                atexit.register(_close_shared)
            # a zygote per environment ever seen would hold ~300 MB each: one for another
            # environment with no child left is stopped
            for other in [k for k, f in _shared.items() if not f.has_children]:
                _shared.pop(other).close()
            forks = _shared[key] = ForkServer(env, preexec_fn, keeper=_keeper)
            forks.start()
        return forks


def _close_shared() -> None:
    with _shared_lock:
        servers = list(_shared.values())
        _shared.clear()
    for forks in servers:
        forks.close()
