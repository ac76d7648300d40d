"""`python -m services.gateway [flags]`: serve the OpenAI API until SIGTERM, then drain."""
from __future__ import annotations

import logging
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
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_port=cfg.reuse_port or None)
        await site.start()
        log.info("gateway listening on http://%s:%d", cfg.host, cfg.port)
        await gw.runtime.stopping.wait()       # SIGTERM / SIGINT
        if cfg.reuse_port:      # a successor shares the port: it takes the new connections
            await site.stop()
            for conn in list(runner.server.connections):
                conn.close()    # keep-alive ones too, each after the response it is writing
        log.info("gateway draining (%d in flight)", gw.in_flight)
        await gw.drain(refuse_new=not cfg.reuse_port)
    finally:
        await runner.cleanup()                 # stops the site; on_cleanup closes NATS


if __name__ == "__main__":
    sys.exit(service_main("gateway", GatewayConfig,
                          lambda cfg: serve(cfg, ModelSpec.load(cfg))))
