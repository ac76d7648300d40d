"""Asking the mesh about itself through the nats.micro protocol ($SRV.PING / $SRV.STATS).

Every pdmesh service registers with nats.micro (shared.service.ServiceRuntime), so one
request on the control subject, with replies collected for a short while, lists them all.
The one way to read a service's $SRV.STATS: `stats` (instances with their stats),
`service_stats` (each instance's stats dict), `total_stats` (summed over instances); the
gateway, the pdmesh tools, scripts and tests all use these.
No torch here: the health check in every container imports this.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.micro.service import ServiceVerb, control_subject

from shared.natsconn import NatsAuth, connect_kwargs

COLLECT_S = 0.5


@dataclass(slots=True)
class Instance:
    """One running service instance as $SRV.PING / $SRV.STATS describe it."""
    service: str                 # micro name: gateway | decode | prefill | kvstore
    id: str                      # micro's own id
    instance_id: str             # pdmesh instance id (micro metadata)
    version: str = ""
    stats: dict[str, Any] = field(default_factory=dict)   # the service's stats handler
    requests: int = 0            # summed over endpoints
    errors: int = 0


async def connect_once(url: str, timeout_s: float = 2.0, auth: NatsAuth | None = None
                       ) -> nats.NATS:
    """One quiet connection attempt (no retry loop, no traceback on refusal); raises
    ConnectionError when the server cannot be reached within timeout_s. url: one server
    or several, comma-separated; identity and TLS: auth, else PDMESH_NATS_* (shared.natsconn)."""

    async def quiet(_e) -> None:
        pass

    try:
        return await asyncio.wait_for(nats.connect(
            **connect_kwargs(url, auth or NatsAuth.from_env()), connect_timeout=timeout_s,
            allow_reconnect=False, max_reconnect_attempts=1, error_cb=quiet), timeout_s + 0.5)
    except Exception as e:  # noqa: BLE001 - refused, timed out, no servers
        raise ConnectionError(f"cannot reach nats at {url}: {e!r}") from e


async def collect(nc: nats.NATS, subject: str, wait_s: float = COLLECT_S,
                  payload: bytes = b"", expect: int | None = None) -> list[Any]:
    """Publish one request and gather every reply that arrives within wait_s (or until
    `expect` replies arrived, when given)."""
    replies: list[Any] = []
    enough = asyncio.Event()

    async def on_reply(msg) -> None:
        replies.append(msg)
        if expect is not None and len(replies) >= expect:
            enough.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, payload, reply=inbox)
        await nc.flush()
        try:
            await asyncio.wait_for(enough.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
    finally:
        await sub.unsubscribe()
    return replies[:expect] if expect is not None else replies


def _json(data: bytes) -> dict | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def ping(nc: nats.NATS, service: str | None = None, wait_s: float = COLLECT_S,
               expect: int | None = None) -> list[Instance]:
    """Every instance (of `service`, or all) that answers $SRV.PING within wait_s (or the
    first `expect` to answer)."""
    out = []
    for msg in await collect(nc, control_subject(ServiceVerb.PING, service), wait_s,
                             expect=expect):
        d = _json(msg.data)
        if d and "name" in d:
            out.append(Instance(service=d["name"], id=d.get("id", ""),
                                instance_id=(d.get("metadata") or {}).get("instance_id", ""),
                                version=d.get("version", "")))
    return out


async def stats(nc: nats.NATS, service: str | None = None, wait_s: float = COLLECT_S,
                expect: int | None = None) -> list[Instance]:
    """Every instance (of `service`, or all) that answers $SRV.STATS within wait_s; the
    stats dict is the service's stats handler (the same on each of its endpoints)."""
    out = []
    subject = control_subject(ServiceVerb.STATS, service)
    for msg in await collect(nc, subject, wait_s, expect=expect):
        d = _json(msg.data)
        if not d or "name" not in d:
            continue
        eps = d.get("endpoints") or []
        data = next((e["data"] for e in eps if isinstance(e.get("data"), dict)), {})
        out.append(Instance(service=d["name"], id=d.get("id", ""),
                            instance_id=(d.get("metadata") or {}).get("instance_id", ""),
                            version=d.get("version", ""), stats=data,
                            requests=sum(e.get("num_requests", 0) for e in eps),
                            errors=sum(e.get("num_errors", 0) for e in eps)))
    return out


async def survey(nc: nats.NATS, wait_s: float = COLLECT_S) -> list[Instance]:
    """PING and STATS together: an instance that answers PING but not STATS still shows."""
    pinged, stated = await asyncio.gather(ping(nc, wait_s=wait_s), stats(nc, wait_s=wait_s))
    by_id = {i.id: i for i in stated}
    for i in pinged:
        by_id.setdefault(i.id, i)
    return sorted(by_id.values(), key=lambda i: (i.service, i.instance_id))


async def service_stats(nc_or_url: nats.NATS | str, service: str, wait_s: float = COLLECT_S,
                        expect: int | None = None) -> list[dict[str, Any]]:
    """Each answering instance's $SRV.STATS data. nc_or_url: a connection, or a NATS URL
    to connect to for this one question (ConnectionError when it cannot be reached).
    expect: stop waiting once that many instances answered."""
    if not isinstance(nc_or_url, str):
        return [i.stats for i in await stats(nc_or_url, service, wait_s, expect)]
    nc = await connect_once(nc_or_url)
    try:
        return [i.stats for i in await stats(nc, service, wait_s, expect)]
    finally:
        await nc.close()


def sum_stats(per_instance: Iterable[dict[str, Any]]) -> dict[str, int | float]:
    """The numeric counters summed over instances (booleans and other values skipped)."""
    total: dict[str, int | float] = {}
    for data in per_instance:
        for k, v in data.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total


async def total_stats(nc_or_url: nats.NATS | str, service: str,
                      wait_s: float = COLLECT_S) -> dict[str, int | float]:
    """A service's numeric $SRV.STATS counters summed over every instance that answers."""
    return sum_stats(await service_stats(nc_or_url, service, wait_s))
