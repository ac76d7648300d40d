"""A rolling restart of one service of the local mesh (`pdmesh restart SERVICE`): one instance
at a time, each drained, stopped, started again and ready before the next, so that no
request fails (Dynamo's fault suite does the same for upgrades).

  several instances   in place: SIGTERM (the service drains: it refuses new work, which the
                      gateway sends to the others, and finishes what it runs), then the same
                      flags and instance id again, then wait until it serves
  one decode, the     surge: its successor (a new instance) starts first and serves, then the
  gateway             old one drains and stops. Gateways share the port (SO_REUSEPORT) and a
                      draining one stops listening first, so clients never find it closed
  kvstore, a lone     in place: while it is down, lookups miss (decode and prefill compute
  prefill             instead) and decode prefills locally
  nats                node by node, same ports and store; a cluster keeps a quorum
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdmesh.local.launch import ClusterError
from pdmesh.local.procs import Proc

DRAIN_S = 30.0          # a draining instance is killed after this long


async def restart_service(cluster, service: str, report: Callable[[str], None]) -> None:
    """On the cluster's supervisor loop. report: one line per step."""
    names = cluster.names(service)
    if not names:
        raise ClusterError(f"no {service} instance runs in this mesh")
    if service == "nats":
        for name in names:
            report(f"{name}: restarting")
            await cluster.nats.restart([name], cluster.emit, cluster.log_dir)
            await cluster.nats.wait_jetstream(60.0)
            await cluster.until_ready()
            report(f"{name}: back")
        return
    grouped = service == "prefill" and cluster.prefill_group > 0
    surge = service == "gateway" or (service == "decode" and len(names) == 1)
    for name in names:
        old = cluster.procs[name]
        t0 = time.monotonic()
        if surge and not grouped:
            new = cluster.new_proc(service)
            report(f"{name}: starting its successor {new.name}")
            new.spawn(cluster.emit, cluster.log_dir)
            await cluster.until_ready()
            if service == "gateway":
                await _listening(new, cluster.startup_timeout_s)
            report(f"{name}: draining")
            await old.terminate(DRAIN_S)
            del cluster.procs[name]
            report(f"{name}: replaced by {new.name} in {time.monotonic() - t0:.1f} s")
        else:
            report(f"{name}: draining")
            await old.terminate(DRAIN_S)
            old.spawn(cluster.emit, cluster.log_dir)
            await cluster.until_ready()
            report(f"{name}: restarted and ready in {time.monotonic() - t0:.1f} s")
        if cluster.on_start is not None:
            cluster.on_start(cluster.procs.get(name) or new)


async def _listening(p: Proc, timeout_s: float) -> None:
    """Until the gateway logs that it accepts connections (its NATS side answers earlier)."""
    deadline = time.monotonic() + timeout_s
    while not any("gateway listening on" in line for line in list(p.lines)):
        if not p.alive or time.monotonic() > deadline:
            raise ClusterError(f"{p.name} did not start listening:\n{p.tail()}")
        await asyncio.sleep(0.05)
