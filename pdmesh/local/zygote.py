"""python -m pdmesh.local.zygote --fd N --room SPACES: the local mesh's fork server.

Every Python service of a local mesh imports the same ~5 s of libraries (torch, transformers,
xgrammar, aiohttp, nats) before it does anything. This process imports them once, then forks a
child for each service the launcher asks for, which starts where the imports end. Chromium's
zygote and Python's multiprocessing forkserver do the same.

What it imports is third-party only: pdmesh's own modules read their environment when they
are imported, and a child's environment (its NATS identity) is set only after the fork. The
launcher (pdmesh.local.forks) forks here only children whose environment differs from this
process's in PDMESH_* variables alone, and its own Popen otherwise.

A forked child is what `python -m services.X FLAGS` would be:
  - its own session, stdin /dev/null, stdout and stderr the pipe the launcher passed;
  - only the descriptors it was given (the gateway's socket at the same number);
  - its environment, working directory and sys.argv, and `-m`'s __main__;
  - its command line and environment written over this process's own argv and environment
    areas, which /proc/PID/cmdline and /proc/PID/environ show (ps, `pdmesh` tools; the
    --room argument and PDMESH_ZYGOTE_ROOM variable reserve the space, as setproctitle does);
  - SIGKILLed when this process dies (PR_SET_PDEATHSIG), as this one is when its launcher's
    supervisor thread dies.

Protocol, one SOCK_SEQPACKET datagram per message, JSON:
  zygote -> launcher  {"ready": {"argv_room": bytes, "env_room": bytes}}
  launcher -> zygote  {"id": n, "argv": [...], "env": {...}, "cwd": "...", "fds": [targets]}
                      with SCM_RIGHTS [stdout write end, *descriptors for fds]
  zygote -> launcher  {"id": n, "pid": pid} | {"id": n, "error": "..."}
  zygote -> launcher  {"exit": pid, "code": returncode (negative: killed by that signal)}
The launcher closing its end stops the zygote, and its children with it.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys

PRELOAD = ("torch", "numpy", "transformers", "transformers.configuration_utils",
           "transformers.models.auto.configuration_auto",
           "transformers.models.auto.tokenization_auto", "xgrammar", "safetensors",
           "tokenizers", "jinja2", "triton", "aiohttp", "nats", "nats.micro", "msgspec",
           "uvloop", "httpx")
ROOM_ENV = "PDMESH_ZYGOTE_ROOM"
MAX_MSG = 1 << 20
_PR_SET_PDEATHSIG = 1


def preload(names: tuple[str, ...] = PRELOAD) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional: a child imports what it needs itself
            pass


def areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(arg_start, arg_end), (env_start, env_end) of this process (proc(5): stat 48-51)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    a0, a1, e0, e1 = (int(x) for x in fields[45:49])
    return (a0, a1), (e0, e1)


def overwrite(area: tuple[int, int], items: list[str]) -> None:
    """items, NUL-terminated, over the area, the rest zeroed (the last byte stays NUL, so
    the kernel shows the area as it is: items then empty strings)."""
    start, end = area
    data = b"".join(s.encode() + b"\0" for s in items)
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> tuple[dict, list[int]]:
    """Fork on each request; returns only in a forked child, with its request and fds."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    (a0, a1), (e0, e1) = areas()
    send(sock, {"ready": {"argv_room": a1 - a0, "env_room": e1 - e0}})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            reap(sock, children)
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 64)
        if not data:                                  # the launcher is gone: so are we
            for pid in children:
                signal_group(pid)
            os._exit(0)
        req = json.loads(data)
        try:
            pid = os.fork()
        except OSError as e:
            send(sock, {"id": req["id"], "error": str(e)})
            pid = -1
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.detach()
            return req, fds
        for fd in fds:
            os.close(fd)
        if pid > 0:
            children.add(pid)
            send(sock, {"id": req["id"], "pid": pid})


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """sig to a process group, which may be gone already."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def become(req: dict, fds: list[int], zygote_pid: int) -> str:
    """Turn this forked child into req's process; returns the module to run as __main__."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != zygote_pid:                    # the zygote died before prctl
        os._exit(1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out, given = fds[0], fds[1:]
    high = [os.dup(fd) for fd in given]              # out of the targets' way, then placed
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    targets = list(req["fds"])
    for src, dst in zip(high, targets):
        os.dup2(src, dst)                             # inheritable, like Popen's pass_fds
    keep = sorted({0, 1, 2, *targets})
    for lo, hi in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(lo + 1, hi)
    argv, env = req["argv"], req["env"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    arg_area, env_area = areas()
    overwrite(arg_area, argv)
    overwrite(env_area, [f"{k}={v}" for k, v in env.items()])
    module = argv[2]                                  # [python, "-m", module, *flags]
    sys.argv = [module, *argv[3:]]
    return module


def main() -> None:
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    os.environ.pop(ROOM_ENV, None)
    sock = socket.socket(fileno=fd)
    zygote_pid = os.getpid()
    preload()
    req, fds = serve(sock)
    module = become(req, fds, zygote_pid)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
