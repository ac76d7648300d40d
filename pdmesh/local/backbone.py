"""The NATS side of a local mesh (pdmesh.local.cluster), up before any service and down after
the last: the credentials (pdmesh.deploy.creds: a user per service, TLS), the nats-server(s)
(pdmesh.local.natsgroup) and the job stream's keeper (pdmesh.deploy.streamkeeper), the only
writer of the stream's configuration, which runs on the cluster's supervisor loop."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pdmesh.deploy.creds import Secrets
from pdmesh.deploy.streamkeeper import StreamKeeper
from pdmesh.local.natsgroup import NatsGroup
from shared.subjects import ADMIN


class Backbone:
    def __init__(self, tmp: Path, size: int, *, port: int = 0, http_port: int | None = None,
                 listen_host: str = "127.0.0.1", auth: bool = True, tls: bool = False):
        """Writes the credentials and node configs into tmp; starts nothing."""
        self.secrets = (Secrets.create(tmp / "secrets", auth=auth, tls=tls)
                        if auth or tls else None)
        self.nats = NatsGroup(size, tmp, port=port, http_port=http_port, secrets=self.secrets,
                              listen_host=listen_host)
        self.keeper: StreamKeeper | None = None
        self._keep: asyncio.Task | None = None

    def env(self, service: str) -> dict[str, str]:
        """What a service's process needs to connect as its own user."""
        return self.secrets.env(service) if self.secrets is not None else {}

    async def start(self, emit: Callable[[str], None] | None, log_dir: Path | None,
                    timeout_s: float) -> None:
        """The nats-servers until JetStream answers, then the stream provisioned and kept."""
        await self.nats.start(emit, log_dir)
        self.keeper = StreamKeeper(self.nats.client_options(ADMIN))
        await self.keeper.start(timeout_s)
        self._keep = asyncio.ensure_future(self.keeper.run())

    async def stop(self) -> None:
        if self._keep is not None:
            self._keep.cancel()
            self._keep = None
        if self.keeper is not None:
            await self.keeper.close()
            self.keeper = None
        await self.nats.stop()
