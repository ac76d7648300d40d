"""The job stream's keeper: connects as the admin identity, provisions the prefill job
stream, and every few seconds puts back whatever differs from its configuration (a
deleted stream, a lost store, a changed field: shared/jobstream.py). No service may touch
the stream's configuration; this is the only writer.

`pdmesh up` (pdmesh/local/cluster.py) runs it on its own loop before it starts any service;
compose runs it as the `jobstream` container:

    python -m pdmesh.deploy.streamkeeper            # PDMESH_NATS_URL, PDMESH_NATS_USER=admin, ...
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

import nats

from shared import jobstream
from shared.natsconn import NatsAuth, connect_kwargs
from shared.service import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S

log = logging.getLogger("pdmesh.deploy.streamkeeper")
EVERY_S = 2.0


class StreamKeeper:
    def __init__(self, options: dict[str, Any], every_s: float = EVERY_S):
        self.options, self.every_s = options, every_s
        self.nc: nats.NATS | None = None
        self.repairs = 0

    async def start(self, wait_s: float = 60.0) -> int:
        """Connect and provision the stream; returns its replicas."""
        self.nc = await nats.connect(**self.options, name="pdmesh-streamkeeper",
                                     max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                     ping_interval=PING_INTERVAL_S,
                                     max_outstanding_pings=MAX_OUTSTANDING_PINGS)
        return await jobstream.ensure_stream(self.nc.jetstream(), wait_s=wait_s)

    async def check(self) -> None:
        """One look at the stream; repairs it when it is missing or changed."""
        js = self.nc.jetstream(timeout=self.every_s)
        try:
            if not await jobstream.stream_drift(js):
                return
        except jobstream.NotFoundError:
            pass
        await jobstream.ensure_stream(js, wait_s=self.every_s)
        self.repairs += 1

    async def run(self) -> None:
        """check() every every_s until cancelled; a failed check is tried again."""
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the server is away: next round
                log.info("job stream check failed: %r", e)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()
            self.nc = None


async def _main(url: str, every_s: float) -> None:
    keeper = StreamKeeper(connect_kwargs(url, NatsAuth.from_env()), every_s)
    replicas = await keeper.start()
    log.info("job stream provisioned (%d replicas); checking it every %.0fs", replicas, every_s)
    try:
        await keeper.run()
    finally:
        await keeper.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.deploy.streamkeeper",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--nats-url", default=os.environ.get("PDMESH_NATS_URL",
                                                         "nats://127.0.0.1:4222"))
    ap.add_argument("--every", type=float, default=EVERY_S, help="seconds between checks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(_main(args.nats_url, args.every))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
