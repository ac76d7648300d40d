"""nats-server config files for pdmesh: one node, or a cluster of N with JetStream.

The same text serves `pdmesh up` (loopback, ports picked per run, stores in the run
directory) and compose (`python -m pdmesh.deploy.creds`: hostnames nats-0..2, fixed ports). A
node's file holds what is its own (name, ports, store, routes) and includes the shared
parts written beside it: `auth.conf` (users and permissions, pdmesh.deploy.creds) and TLS.

    nodes = plan_nodes(3, host="127.0.0.1", ports=[...], cluster_ports=[...])
    text = node_conf(nodes[0], nodes, store_dir=run / "jetstream-0")
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_PAYLOAD = "8MB"          # nats-server reads MB as MiB: 8388608 bytes (KV writes, jobs)
# How far a connection may fall behind before the server drops it as a slow consumer
# (default 64 MB): decode's inbound KV is bounded per job (kv_window x max_payload = 64 MiB),
# and a prefill worker runs up to 4 jobs at once, so one worker's writes alone reach 256 MiB
MAX_PENDING = "256MB"
CLUSTER_NAME = "pdmesh"


@dataclass
class NatsNode:
    name: str                  # server_name; also the process name in pdmesh.local.cluster
    host: str                  # how clients and peers reach it
    port: int                  # client port
    cluster_port: int = 0      # route port (0: not clustered)
    http_port: int | None = None
    listen_host: str = ""      # bind address ("" = host)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def route(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"


@dataclass
class Tls:
    """Server certificate and the CA clients and peers verify it with (pdmesh.deploy.creds)."""
    cert: Path
    key: Path
    ca: Path


def node_names(n: int) -> list[str]:
    """"nats" alone; "nats-0".."nats-{n-1}" in a cluster."""
    return ["nats"] if n == 1 else [f"nats-{i}" for i in range(n)]


def plan_nodes(n: int, host: str, ports: list[int], cluster_ports: list[int] | None = None,
               http_ports: list[int | None] | None = None, hosts: list[str] | None = None,
               listen_host: str = "") -> list[NatsNode]:
    names = node_names(n)
    return [NatsNode(name=names[i], host=(hosts[i] if hosts else host), port=ports[i],
                     cluster_port=(cluster_ports[i] if cluster_ports and n > 1 else 0),
                     http_port=(http_ports[i] if http_ports else None),
                     listen_host=listen_host)
            for i in range(n)]


def node_conf(node: NatsNode, nodes: list[NatsNode], store_dir: str | Path,
              auth_include: str | None = None, route_auth: tuple[str, str] | None = None,
              tls: Tls | None = None, header: str = "written by pdmesh; removed on exit") -> str:
    """One node's config: its listener, 8 MiB payloads, JetStream stored under store_dir,
    routes to every other node (a cluster), `include auth_include` (users, permissions),
    TLS for clients and routes."""
    bind = node.listen_host or node.host
    lines = [f"# {header}",
             f"server_name: {node.name}",
             f"listen: {bind}:{node.port}",
             f"max_payload: {MAX_PAYLOAD}",
             f"max_pending: {MAX_PENDING}",
             "jetstream {", f"  store_dir: \"{store_dir}\"", "}"]
    if node.http_port:
        lines.append(f"http: {bind}:{node.http_port}")
    if tls is not None:
        lines += ["tls {", *_tls_lines(tls, verify=False), "}"]
    if node.cluster_port:
        lines += _cluster_lines(node, nodes, bind, route_auth, tls)
    if auth_include:
        lines.append(f"include \"{auth_include}\"")
    return "\n".join(lines) + "\n"


def _tls_lines(tls: Tls, verify: bool) -> list[str]:
    out = [f"  cert_file: \"{tls.cert}\"", f"  key_file: \"{tls.key}\"",
           f"  ca_file: \"{tls.ca}\"", "  timeout: 5"]
    if verify:
        out.append("  verify: true")
    return out


def _cluster_lines(node: NatsNode, nodes: list[NatsNode], bind: str,
                   route_auth: tuple[str, str] | None, tls: Tls | None) -> list[str]:
    routes = [p for p in nodes if p.name != node.name]
    out = ["cluster {", f"  name: {CLUSTER_NAME}", f"  listen: {bind}:{node.cluster_port}"]
    if route_auth is not None:
        user, password = route_auth
        out += ["  authorization {", f"    user: \"{user}\"", f"    password: \"{password}\"",
                "  }"]
        routes_txt = [f"nats-route://{user}:{password}@{p.host}:{p.cluster_port}"
                      for p in routes]
    else:
        routes_txt = [p.route for p in routes]
    if tls is not None:     # routes verify each other with the same CA
        out += ["  tls {", *("  " + s for s in _tls_lines(tls, verify=True)), "  }"]
    out += ["  routes: [", *(f"    {r}" for r in routes_txt), "  ]", "}"]
    return out


def servers(nodes: list[NatsNode], scheme: str = "nats") -> str:
    """The comma-separated client URL list every service is given."""
    return ",".join(f"{scheme}://{n.host}:{n.port}" for n in nodes)


# ---- compose: one file for every node (server_name from the environment) ----------------
COMPOSE_NODES = [f"nats-{i}" for i in range(3)]
COMPOSE_PORTS = {"client": 4222, "cluster": 6222, "http": 8222}


def compose_conf() -> str:
    """deploy/nats.conf: every compose nats service runs it with SERVER_NAME=nats-<i>.
    The secrets beside it come from `python -m pdmesh.deploy.creds deploy/secrets`: auth.conf
    (users and their grants) and routes.conf (route credentials and the routes; a node's
    own route is recognised and ignored by nats-server)."""
    p = COMPOSE_PORTS
    return "\n".join([
        "# nats-server for compose.yaml: nats-0..2, one JetStream cluster.",
        "# generated by pdmesh/deploy/natsconf.py compose_conf() (tests/test_compose.py compares)",
        "server_name: $SERVER_NAME",
        f"listen: 0.0.0.0:{p['client']}",
        f"http: 127.0.0.1:{p['http']}          # /healthz for the container health check only",
        f"max_payload: {MAX_PAYLOAD}           # KV block writes travel as single messages",
        f"max_pending: {MAX_PENDING}         # decode may fall this far behind its KV writes",
        "jetstream {",
        "  store_dir: /data              # prefill job queue (work-queue stream, R3)",
        "}",
        "cluster {",
        f"  name: {CLUSTER_NAME}",
        f"  listen: 0.0.0.0:{p['cluster']}",
        "  include \"routes.conf\"        # secret: route user and routes (pdmesh.deploy.creds)",
        "}",
        "include \"auth.conf\"            # secret: one user per service (pdmesh.deploy.creds)",
    ]) + "\n"
