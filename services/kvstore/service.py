"""Kvstore service: the NATS face of the hierarchical KV cache (HiCache).

For now it only runs: it registers with nats.micro, answers health (its own instance
subject and the shared `pdmesh.kvstore.health` work subject), reports stats and beats.
The cache itself (tiers engine memory -> host -> disk, prefix index, layer-wise loads)
belongs in a core module that does no I/O; this service will hold one and expose its
verbs as endpoints. The seam is `Store`: anything with `stats()` in the shape below.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from shared import subjects
from shared.contracts.common import encode
from shared.contracts.messages import Health, Heartbeat
from shared.service import ServiceRuntime, new_instance_id

from .config import KvstoreConfig

log = logging.getLogger("pdmesh.kvstore")

TIERS = ("host", "disk")


class Store(Protocol):
    def stats(self) -> dict:
        """{"entries": int, "bytes": int, "tiers": {tier: {"entries": int, "bytes": int}}}"""


class EmptyStore:
    """Placeholder until the tiered store lands: holds nothing."""

    def stats(self) -> dict:
        return {"entries": 0, "bytes": 0,
                "tiers": {t: {"entries": 0, "bytes": 0} for t in TIERS}}


class KvstoreService:
    def __init__(self, cfg: KvstoreConfig, store: Store | None = None):
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("kvstore")
        self.store = store or EmptyStore()
        self.rt = ServiceRuntime("kvstore", self.iid, cfg.nats_url, stats=self.stats)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.rt.start()
        # any kvstore instance answers here (queue group): "is a kvstore up at all?"
        await self.rt.endpoint("health_any", subjects.kvstore_health(), self.on_health, None,
                               queue_group="kvstore")
        log.info("kvstore %s ready", self.iid)

    async def serve(self) -> None:
        await self.start()
        try:
            await self.rt.run(heartbeat=self.heartbeat)
        finally:
            await self.rt.close()

    # ---- handlers ---------------------------------------------------------------------
    async def on_health(self, _req) -> bytes:
        return encode(Health(service="kvstore", instance_id=self.iid,
                             ok=not self.rt.stopping.is_set()))

    def stats(self) -> dict:
        return self.store.stats()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service="kvstore", instance_id=self.iid, ts=time.time())
