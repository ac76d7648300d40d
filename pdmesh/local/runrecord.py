"""Where a running `pdmesh up` says what it serves, so `pdmesh status`, `tail` and `restart`
find it with no flags.

One JSON file per running mesh, `up-<pid>.json`, mode 0600, in the run directory:
$PDMESH_RUN_DIR, else $XDG_RUNTIME_DIR/pdmesh, else ~/.cache/pdmesh/run. It holds URLs and
the *path* of the read-only debug user's password file (never a password), the control
socket, and each child's pid. Written when the mesh is ready and whenever a child is
started again; removed when `pdmesh up` stops. A record whose pid is gone is stale: skipped
(and removed) by `find()`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def run_dir() -> Path:
    if os.environ.get("PDMESH_RUN_DIR"):
        return Path(os.environ["PDMESH_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "pdmesh"
    return Path.home() / ".cache" / "pdmesh" / "run"


def path_for(pid: int, d: Path | None = None) -> Path:
    return (d or run_dir()) / f"up-{pid}.json"


def write(record: dict[str, Any], pid: int | None = None) -> Path:
    """Atomically (write + rename), readable by this user only."""
    pid = pid or os.getpid()
    d = run_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = path_for(pid)
    tmp = target.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": pid} | record, f, indent=2)
    os.replace(tmp, target)
    return target


def remove(pid: int | None = None) -> None:
    path_for(pid or os.getpid()).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's process with a recycled pid
        return False
    return True


def debug_auth(record: dict[str, Any]):
    """How to connect to the recorded mesh: its read-only debug user (shared.natsconn)."""
    from shared.natsconn import NatsAuth

    return NatsAuth(user=record.get("nats_user", ""),
                    password_file=record.get("nats_password_file", ""),
                    tls_ca=record.get("nats_tls_ca", ""))


def find(pid: int | None = None, d: Path | None = None) -> dict[str, Any] | None:
    """The record of the running mesh (pid: that one; else the newest live one), in d (default:
    run_dir())."""
    d = d or run_dir()
    if pid is not None:
        paths = [path_for(pid, d)]
    else:
        paths = sorted(d.glob("up-*.json"), key=lambda p: p.stat().st_mtime, reverse=True) \
            if d.is_dir() else []
    for p in paths:
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and _alive(int(rec.get("pid", 0))):
            return rec
        p.unlink(missing_ok=True)       # stale: its pdmesh up is gone
    return None
