"""Is the local mesh serving? What `Cluster` waits for after a start or a restart: GET /ready
answers 200 (every path usable) and a $SRV.PING finds every instance that should run."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdmesh.local.launch import ClusterError
from pdmesh.local.procs import Proc

POLL_S = 0.2        # between two looks (each a GET /ready and a $SRV.PING)


async def wait_ready(procs: Mapping[str, Proc], url: str, nats_options: dict[str, Any],
                     timeout_s: float, check_alive: Callable[[list[str]], None]) -> None:
    """Until missing() is empty; ClusterError after timeout_s, with the missing children's
    last lines. check_alive(names of the children not asked to exit) raises to fail early."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            check_alive([n for n, p in procs.items() if not p.expected_exit])
            gone = await missing(procs.values(), http, url, nats_options)
            if not gone:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"not ready after {timeout_s:.0f}s: {', '.join(gone)}\n"
                                   + "\n".join(f"--- {n}\n{procs[n].tail(15)}"
                                               for n in gone if n in procs))
            await asyncio.sleep(POLL_S)


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
        found = await micro.ping(nc, expect=len(want) or None)   # all answered: done
    finally:
        await nc.close()
    seen = {(i.service, i.instance_id) for i in found}
    return out + [p.name for p in want
                  if (p.service, p.instance_id) not in seen and p.name not in out]


async def _quiet(_e) -> None:
    pass
