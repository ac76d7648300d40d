"""All four services in this process (so one in-memory span exporter sees them all), each
the real service class with its own NATS connection to a real nats-server, and the
gateway's aiohttp app over real HTTP. Each service exports as itself: tracing gives every
service a TracerProvider of its own (resource service.name = pdmesh-<service>)."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from aiohttp.test_utils import TestClient, TestServer

from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from services.kvstore.config import KvstoreConfig
from services.kvstore.service import KvstoreService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from shared.settings import build

DET = {"deterministic": True, "dtype": "float32", "threads": 1, "block_size": 16,
       "chunk_size": 32, "max_num_batched_tokens": 128, "num_blocks": 256}


@asynccontextmanager
async def local_mesh(nats_url: str, model, tmp_path, **engine):
    """(http client, {service: instance}) with kvstore, prefill, decode (mode pd) and the
    gateway up, and the gateway seeing decode's heartbeats."""
    base = {"model": str(model), "nats_url": nats_url} | DET | engine
    kv = KvstoreService(build(KvstoreConfig, {"nats_url": nats_url, "host_cache_mb": 64,
                                              "disk_cache_mb": 0, "disk_dir": str(tmp_path)}))
    pre = PrefillService(build(PrefillConfig, base))
    dec = DecodeService(build(DecodeConfig, base | {"mode": "pd"}))
    services = {"kvstore": kv, "prefill": pre, "decode": dec}
    runs = []
    for svc in services.values():
        await svc.start()
        beat = getattr(svc, "heartbeat", None)
        runs.append(asyncio.ensure_future(svc.rt.run(heartbeat=beat)))
    cfg = GatewayConfig(model=str(model), nats_url=nats_url, request_timeout_s=60)
    try:
        async with TestClient(TestServer(create_app(cfg))) as http:
            registry = http.server.app[GATEWAY].registry
            deadline = time.monotonic() + 15
            while not registry.alive(time.monotonic()):
                assert time.monotonic() < deadline, "the gateway saw no decode heartbeat"
                await asyncio.sleep(0.05)
            yield http, services
    finally:
        for svc in services.values():
            svc.rt.stopping.set()
        await asyncio.gather(*runs, return_exceptions=True)
        for svc in services.values():
            await svc.rt.close()
            executor = getattr(svc, "executor", None) or getattr(svc, "io", None)
            executor.shutdown(wait=True)
