"""Asking the mesh about itself through the nats.micro protocol ($SRV.PING / $SRV.STATS).

Every pdmesh service registers with nats.micro (shared.service.ServiceRuntime), so one
request on the control subject, with replies collected for a short while, lists them all.
No torch here: the health check in every container imports this.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.micro.service import ServiceVerb, control_subject

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


async def connect_once(url: str, timeout_s: float = 2.0) -> nats.NATS:
    """One quiet connection attempt (no retry loop, no traceback on refusal); raises
    ConnectionError when the server cannot be reached within timeout_s."""

    async def quiet(_e) -> None:
        pass

    try:
        return await asyncio.wait_for(nats.connect(
            url, connect_timeout=timeout_s, allow_reconnect=False, max_reconnect_attempts=1,
            error_cb=quiet), timeout_s + 0.5)
    except Exception as e:  # noqa: BLE001 - refused, timed out, no servers
        raise ConnectionError(f"cannot reach nats at {url}: {e!r}") from e


async def collect(nc: nats.NATS, subject: str, wait_s: float = COLLECT_S,
                  payload: bytes = b"") -> list[Any]:
    """Publish one request and gather every reply that arrives within wait_s."""
    replies: list[Any] = []

    async def on_reply(msg) -> None:
        replies.append(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, payload, reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return replies


def _json(data: bytes) -> dict | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def ping(nc: nats.NATS, service: str | None = None,
               wait_s: float = COLLECT_S) -> list[Instance]:
    out = []
    for msg in await collect(nc, control_subject(ServiceVerb.PING, service), wait_s):
        d = _json(msg.data)
        if d and "name" in d:
            out.append(Instance(service=d["name"], id=d.get("id", ""),
                                instance_id=(d.get("metadata") or {}).get("instance_id", ""),
                                version=d.get("version", "")))
    return out


async def stats(nc: nats.NATS, service: str | None = None,
                wait_s: float = COLLECT_S) -> list[Instance]:
    out = []
    for msg in await collect(nc, control_subject(ServiceVerb.STATS, service), wait_s):
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
