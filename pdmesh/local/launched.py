"""`pdmesh up` as a user launches it, driven from outside: a subprocess with its own run
directory, found through its run record, its children killed by pid as an operator would
(`kill -9`), restarted with `pdmesh restart`. What the fault tests and scripts/faults_bench.py
run, so that they prove the product and not a harness.

    async with UpMesh("--model", "models/tiny-target", "--decode", "2") as m:
        m.url; m.sigkill("decode-1"); await m.back("decode-1", old_pid)
        await m.restart("gateway")
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from pdmesh.local import runrecord


class UpMesh:
    def __init__(self, *flags: str, env: dict[str, str] | None = None,
                 start_timeout_s: float = 300.0):
        """flags: pdmesh up's command line (--port 0 is added unless given)."""
        self.flags = list(flags) + ([] if "--port" in flags else ["--port", "0"])
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdmesh-run-"))
        self.env = dict(os.environ) | (env or {}) | {"PDMESH_RUN_DIR": str(self.run_dir),
                                                      "PYTHONUNBUFFERED": "1"}
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=4000)
        self._reader: asyncio.Task | None = None

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self) -> "UpMesh":
        self.proc = await asyncio.to_thread(
            subprocess.Popen, [sys.executable, "-m", "pdmesh", "up", *self.flags],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        self._reader = asyncio.ensure_future(asyncio.to_thread(self._read))
        deadline = time.monotonic() + self.start_timeout_s
        while not any(line.startswith("pdmesh is up:") for line in list(self.lines)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdmesh up exited with {self.proc.returncode}:\n"
                                   + self.tail(60))
            if time.monotonic() > deadline:
                raise RuntimeError("pdmesh up not ready in time:\n" + self.tail(60))
            await asyncio.sleep(0.2)
        return self

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, as Ctrl-C: the mesh drains and stops; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        except asyncio.TimeoutError:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self._reader is not None:
            await self._reader
        return self.proc.returncode

    async def __aenter__(self) -> "UpMesh":
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- what it says about itself ----------------------------------------------------------
    def record(self) -> dict[str, Any]:
        rec = runrecord.find(self.proc.pid, self.run_dir)
        if rec is None:
            raise RuntimeError("no run record for this pdmesh up:\n" + self.tail(30))
        return rec

    @property
    def url(self) -> str:
        return self.record()["url"]

    def pid(self, name: str) -> int:
        return self.record()["children"][name]

    async def nats(self, rec: dict[str, Any] | None = None):
        """A NATS connection to this mesh as its read-only debug user."""
        from shared import micro

        rec = rec or self.record()
        return await micro.connect_once(rec["nats_url"], auth=runrecord.debug_auth(rec))

    def gateway_name(self) -> str:
        """The gateway child's name (a rolling restart replaces gateway-0 by gateway-1)."""
        return next(n for n in self.record()["children"] if n.startswith("gateway-"))

    async def metrics(self) -> str:
        """The gateway's /metrics page."""
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.get(self.url + "/metrics") as r:
                return await r.text()

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    # ---- what an operator does ---------------------------------------------------------------
    def sigkill(self, name: str) -> int:
        """kill -9 one child by its pid (not its group, not through the launcher)."""
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    async def back(self, name: str, old_pid: int, timeout_s: float = 60.0) -> float:
        """Seconds until the child runs again under a new pid and serves: a service answers
        $SRV.PING under its instance id, a nats-server accepts connections on its port, and
        the mesh is ready (GET /ready)."""
        import aiohttp

        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                rec = self.record()
                pid = rec["children"].get(name)
                if (pid and pid != old_pid and await self._serves(name, rec)
                        and await _ready(http, rec["url"])):
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{name} not back in {timeout_s:.0f} s:\n{self.tail(30)}")
                await asyncio.sleep(0.1)

    async def _serves(self, name: str, rec: dict[str, Any]) -> bool:
        from shared import micro

        service, _, index = name.rpartition("-")
        urls = rec["nats_url"].split(",")
        if service == "nats" or name == "nats":      # its own port answers
            host, port = urls[int(index) if index.isdigit() else 0].rsplit("//", 1)[1].split(":")
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 1.0)
            except (OSError, asyncio.TimeoutError):
                return False
            w.close()
            return True
        try:
            nc = await self.nats(rec)
        except ConnectionError:
            return False
        try:
            found = await micro.ping(nc, service, wait_s=0.2)
        finally:
            await nc.close()
        return any(i.instance_id == f"{service}_{index}" for i in found)

    def spawn_like(self, child: str, instance_id: str, nats_host: str = "127.0.0.1",
                   wrap=lambda argv: argv, extra: list[str] = ()) -> subprocess.Popen:
        """One more instance of child's service, as an operator adds one by hand on another
        host: child's own command line and environment (its NATS user and password file),
        a new instance id, its NATS URLs' host replaced by nats_host (how that host reaches
        this mesh's nats-server: pdmesh up --nats-host), run through wrap(argv) (e.g.
        netlab.Host.command), with extra flags added. Its output goes to
        <run dir>/<instance_id>.log. Not supervised: the caller stops it."""
        pid = self.pid(child)
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        env = dict(kv.decode().split("=", 1) for kv in
                   Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        for flag, value in (("--instance-id", instance_id), ("--nats-url", None)):
            i = argv.index(flag) + 1
            argv[i] = value if value is not None else ",".join(
                u.replace("127.0.0.1", nats_host) for u in argv[i].split(","))
        argv += list(extra)
        log = open(self.run_dir / f"{instance_id}.log", "ab")
        try:
            return subprocess.Popen(wrap(argv), env=env, cwd=os.readlink(f"/proc/{pid}/cwd"),
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        finally:
            log.close()

    def nats_node_ports(self, node: str) -> list[int]:
        """A nats-server child's client and route ports (from its config file)."""
        argv = Path(f"/proc/{self.pid(node)}/cmdline").read_bytes().split(b"\0")
        conf = Path(argv[argv.index(b"-c") + 1].decode()).read_text()
        return [int(p) for p in re.findall(r"listen: [\d.]+:(\d+)", conf)]

    async def restart(self, service: str, timeout_s: float = 300.0) -> tuple[int, str]:
        """`pdmesh restart SERVICE`: (exit code, its output)."""
        return await self.cli("restart", service, timeout_s=timeout_s)

    async def cli(self, *args: str, timeout_s: float = 60.0) -> tuple[int, str]:
        """Any pdmesh subcommand, as the user runs it beside this mesh."""
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdmesh", *args, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(p.communicate(), timeout_s)
        return p.returncode, out.decode()


async def _ready(http, url: str) -> bool:
    try:
        async with http.get(url + "/ready") as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not yet
        return False
