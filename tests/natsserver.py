"""A bare nats-server for a test, on a port it picks itself (`-p -1`) and reports in its
ports file: no window between choosing a free port and binding it in which another test
worker's server (or a node restarted on its old port) can take it."""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from pdmesh.local.launch import nats_server_binary


def start(*args: str, timeout_s: float = 20.0) -> tuple[subprocess.Popen, int]:
    """(the process, its client port) once it listens; args: more nats-server flags."""
    ports = Path(tempfile.mkdtemp(prefix="nats-ports-"))
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", "-1",
                             "--ports_file_dir", str(ports), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        for f in ports.glob("*.ports"):
            try:
                url = json.loads(f.read_text())["nats"][0]
            except (ValueError, KeyError, IndexError):
                continue                                  # still being written
            return proc, int(url.rsplit(":", 1)[1])
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"nats-server {' '.join(args)} did not start "
                               f"(exit {proc.poll()})")
        time.sleep(0.02)
