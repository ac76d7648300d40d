"""`python -m services.gateway [flags]`: serve the OpenAI API until SIGTERM, then drain."""
from __future__ import annotations

import logging
import socket
import sys

from aiohttp import web

from shared.settings import service_main

from .app import GATEWAY, create_app
from .config import GatewayConfig
from .model import ModelSpec

log = logging.getLogger("pdmesh.gateway")


async def serve(cfg: GatewayConfig, spec: ModelSpec | None = None) -> None:
    app = create_app(cfg, spec)
    # handler_cancellation: a non-streaming request whose client left is cancelled (and
    # aborted at decode) at once instead of at the next liveness tick
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=3.0)
    await runner.setup()                       # on_startup: NATS, micro, subscriptions
    gw = app[GATEWAY]
    try:
        shared = cfg.listen_fd >= 0            # the launcher's socket (handover.py)
        site = (web.SockSite(runner, socket.socket(fileno=cfg.listen_fd)) if shared
                else web.TCPSite(runner, cfg.host, cfg.port))
        await site.start()
        log.info("gateway listening on http://%s:%d", cfg.host, cfg.port)
        await gw.runtime.stopping.wait()       # SIGTERM / SIGINT
        if shared:              # stop accepting: a successor accepts from the same socket
            await site.stop()
            gw.handover.begin()
        log.info("gateway draining (%d in flight)", gw.in_flight)
        await gw.drain(refuse_new=not shared)
    finally:
        await runner.cleanup()                 # stops the site; on_cleanup closes NATS


if __name__ == "__main__":
    sys.exit(service_main("gateway", GatewayConfig,
                          lambda cfg: serve(cfg, ModelSpec.load(cfg))))
