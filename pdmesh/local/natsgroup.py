"""The nats-servers of a local mesh (pdmesh.local.cluster): one, or a JetStream cluster of N.

Each node is a child process named "nats" (alone) or "nats-0".."nats-{N-1}", with its
config file and JetStream store in the run directory. Start waits until every node
accepts connections and JetStream answers (a cluster has elected its meta leader). A node
can be killed, restarted (same ports, same store, or a wiped store) on its own.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from pdmesh.deploy.natsconf import NatsNode, node_conf as render_conf, plan_nodes, servers
from pdmesh.local.launch import ClusterError, free_port, nats_server_binary
from pdmesh.local.procs import Proc
from shared.natsconn import NatsAuth, connect_kwargs


class NatsGroup:
    def __init__(self, size: int, tmp: Path, *, port: int = 0, http_port: int | None = None,
                 secrets: Any = None, listen_host: str = "127.0.0.1"):
        """size: nodes (1, or 3 for a cluster). port/http_port: node 0's (0: free ones;
        the others take free ones). secrets: pdmesh.deploy.creds.Secrets for auth and TLS.
        listen_host: the address they bind (clients and routes here use 127.0.0.1)."""
        if size < 1:
            raise ValueError("nats_cluster must be >= 1")
        self.size, self.tmp, self.secrets = size, tmp, secrets
        ports = [port or free_port()] + [free_port() for _ in range(size - 1)]
        http = [http_port + i if http_port else None for i in range(size)]
        cluster_ports = [free_port() for _ in range(size)] if size > 1 else None
        self.nodes: list[NatsNode] = plan_nodes(size, "127.0.0.1", ports, cluster_ports, http,
                                                listen_host=listen_host)
        self.procs: dict[str, Proc] = {}
        for node in self.nodes:
            conf = self.tmp / f"{node.name}.conf"
            conf.write_text(self.conf_text(node))
            self.procs[node.name] = Proc(node.name, "nats",
                                         [nats_server_binary(), "-c", str(conf)],
                                         dict(os.environ))

    # ---- addresses -----------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return "tls" if self.secrets is not None and self.secrets.tls else "nats"

    @property
    def url(self) -> str:
        """Every node, comma-separated: what services are given."""
        return servers(self.nodes, self.scheme)

    def node(self, name: str) -> NatsNode:
        return next(n for n in self.nodes if n.name == name)

    def store_dir(self, node: NatsNode) -> Path:
        return self.tmp / ("jetstream" if self.size == 1 else f"jetstream-{node.name[5:]}")

    def conf_text(self, node: NatsNode) -> str:
        s = self.secrets
        if s is None:
            return render_conf(node, self.nodes, self.store_dir(node))
        include = s.auth_include and os.path.relpath(s.auth_include, self.tmp)  # nats: relative
        return render_conf(node, self.nodes, self.store_dir(node), auth_include=include,
                           route_auth=s.route_auth, tls=s.tls)

    def auth(self, identity: str | None) -> NatsAuth:
        """How a client connects as identity (None: no identity; with auth on, the
        read-only debug identity)."""
        if self.secrets is None:
            return NatsAuth()
        return self.secrets.auth(identity or "debug")

    def client_options(self, identity: str | None = None) -> dict[str, Any]:
        return connect_kwargs(self.url, self.auth(identity))

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self, emit: Callable[[str], None] | None, log_dir: Path | None,
                    timeout_s: float = 30.0) -> None:
        for p in self.procs.values():
            p.spawn(emit, log_dir)
        for node in self.nodes:
            await self.wait_node(node.name, timeout_s)
        await self.wait_jetstream(timeout_s)

    async def stop(self) -> None:
        await asyncio.gather(*(p.terminate(5.0) for p in self.procs.values()))

    async def restart(self, names: list[str], emit, log_dir, down_s: float = 0.0,
                      wipe_store: bool = False, wait: bool = True) -> None:
        """Stop these nodes, stay down down_s, start them again on the same ports and
        store (wipe_store: an empty store, as if the disk was lost)."""
        await asyncio.gather(*(self.procs[n].terminate(5.0) for n in names))
        await asyncio.sleep(down_s)
        for n in names:
            if wipe_store:
                shutil.rmtree(self.store_dir(self.node(n)), ignore_errors=True)
            self.procs[n].spawn(emit, log_dir)
        if wait:
            for n in names:
                await self.wait_node(n, 30.0)

    async def wait_node(self, name: str, timeout_s: float) -> None:
        """Until this node sends its INFO line on a fresh connection."""
        node, proc = self.node(name), self.procs[name]
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.popen is not None and not proc.alive and not proc.expected_exit:
                raise ClusterError(f"{name} exited with code {proc.returncode}; last lines:\n"
                                   f"{proc.tail()}")
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(node.host, node.port), 1.0)
                try:
                    if (await asyncio.wait_for(r.readline(), 1.0)).startswith(b"INFO"):
                        return
                finally:
                    w.close()
            except (OSError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not accepting on {node.url} after {timeout_s:.0f}s"
                                   f"\n{proc.tail()}")
            await asyncio.sleep(0.1)

    async def wait_jetstream(self, timeout_s: float) -> None:
        """Until JetStream answers an account info request (a cluster: a meta leader)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(**self.client_options(), connect_timeout=2,
                                        allow_reconnect=False, max_reconnect_attempts=1)
            except Exception as e:  # noqa: BLE001 - not yet
                last = e
                await asyncio.sleep(0.2)
                continue
            try:
                await nc.jetstream(timeout=2.0).account_info()
                return
            except Exception as e:  # noqa: BLE001 - no meta leader yet
                last = e
                await asyncio.sleep(0.2)
            finally:
                await nc.close()
        raise ClusterError(f"JetStream not ready after {timeout_s:.0f}s: {last!r}")
