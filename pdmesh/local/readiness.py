"""Is the local mesh serving? What `Cluster` waits for after a start or a restart: GET /ready
answers 200 (every path usable) and a $SRV.PING finds every instance that should run."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from pdmesh.local.procs import Proc


async def missing(procs: Iterable[Proc], http, url: str, nats_options: dict[str, Any]
                  ) -> list[str]:
    """Names of the children (nats-servers aside) that are not serving yet: alive or being
    started again by the supervisor, but without an answer. http: an aiohttp session."""
    import nats

    from shared import micro

    want = [p for p in procs if p.service != "nats" and (p.alive or p.restarting)]
    out = []
    if any(p.service == "gateway" for p in want):   # the only one with HTTP
        try:
            async with http.get(url + "/ready") as r:
                ok = r.status == 200
        except Exception:  # noqa: BLE001 - not up yet
            ok = False
        if not ok:
            out += [p.name for p in want if p.service == "gateway"]
    try:
        nc = await asyncio.wait_for(nats.connect(
            **nats_options, connect_timeout=1.0, allow_reconnect=False,
            max_reconnect_attempts=1, error_cb=_quiet), 2.0)
    except Exception:  # noqa: BLE001 - nats restarting
        return [p.name for p in want]
    try:
        found = await micro.ping(nc)
    finally:
        await nc.close()
    seen = {(i.service, i.instance_id) for i in found}
    return out + [p.name for p in want
                  if (p.service, p.instance_id) not in seen and p.name not in out]


async def _quiet(_e) -> None:
    pass
