"""Kvstore service: the NATS face of the tiered KV cache (HiCache L2 host memory, L3 disk).

Verbs (shared/contracts/kvcache.py):
  lookup  how many leading prefix keys are cached (index only, no disk read)
  fetch   open a load: read and verify the blocks (an L3 hit is promoted to L2; a corrupt
          file is dropped and ends the prefix there); reply how many are available
  layer   one layer of a range of the load's blocks, raw, with per-block crc32s; the
          loader pulls layer 0 first, so compute can start while later layers travel
  put     write-back of complete blocks; each layer's crc32 is checked before the block
          is indexed, so a torn or corrupted write never becomes a hit
The store (tiers.py) does no I/O of its own beyond its files; every call to it runs on
one worker thread, so disk reads never stall the event loop and the store stays
single-threaded. One kvstore per mesh: lookups and fetches use a queue group, layer
pulls go to the instance that opened the load.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from shared import subjects
from shared.contracts.common import Codec, ContractError, ErrorCode, encode
from shared.contracts.kvcache import (
    KvFetch,
    KvFetchReply,
    KvLayerPull,
    KvLookup,
    KvLookupReply,
    KvPut,
    KvPutAck,
)
from shared.contracts.messages import Health, Heartbeat
from shared.engine.prefix import KEY_BYTES
from shared.kv import wire
from shared.service import ServiceError, ServiceRuntime, new_instance_id

from .config import KvstoreConfig
from .tiers import BlockData, DiskTier, MemoryTier, TieredStore

log = logging.getLogger("pdmesh.kvstore")
LAYER = Codec(KvLayerPull)


def _keys(hexes: list[str]) -> list[bytes]:
    """Prefix keys as sent (hex); anything but KEY_BYTES bytes is refused: a key names a
    file under the L3 directory, and an empty one named the directory itself (its temp file
    then went into the directory's parent)."""
    try:
        keys = [bytes.fromhex(h) for h in hexes]
    except (ValueError, TypeError) as e:
        raise ContractError(f"bad prefix key: {e}") from e
    bad = next((h for h, k in zip(hexes, keys) if len(k) != KEY_BYTES), None)
    if bad is not None:
        raise ContractError(f"bad prefix key {bad[:80]!r}: a key is {KEY_BYTES} bytes "
                            f"({2 * KEY_BYTES} hex digits)")
    return keys


def make_store(cfg: KvstoreConfig) -> TieredStore:
    l3 = DiskTier(cfg.disk_dir, int(cfg.disk_cache_mb * 2**20)) if cfg.disk_cache_mb else None
    return TieredStore(MemoryTier(int(cfg.host_cache_mb * 2**20)), l3, cfg.write_through_l3)


class KvstoreService:
    def __init__(self, cfg: KvstoreConfig, store: TieredStore | None = None):
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("kvstore")
        self.store = store or make_store(cfg)
        self.rt = ServiceRuntime("kvstore", self.iid, cfg.nats_url, stats=self.stats,
                                 auth=cfg.nats)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="store")
        self.loads: dict[str, tuple[float, list[BlockData]]] = {}
        self.counters = {"lookups": 0, "lookup_keys": 0, "lookup_hits": 0, "fetches": 0,
                         "blocks_served": 0, "layer_pulls": 0, "puts": 0, "blocks_stored": 0,
                         "blocks_rejected": 0, "loads_expired": 0}

    async def _store(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.rt.start()
        # any kvstore instance answers here (queue group): "is a kvstore up at all?"
        await self.rt.endpoint("health_any", subjects.kvstore_health(), self.on_health, None,
                               queue_group="kvstore")
        await self.rt.endpoint("lookup", subjects.kvstore_lookup(), self.on_lookup,
                               Codec(KvLookup), queue_group="kvstore")
        await self.rt.endpoint("fetch", subjects.kvstore_fetch(), self.on_fetch,
                               Codec(KvFetch), queue_group="kvstore")
        await self.rt.endpoint("layer", subjects.kvstore_layer(self.iid), self.on_layer, None,
                               raw=True)
        await self.rt.endpoint("put", subjects.kvstore_put(), self.on_put, None, raw=True,
                               queue_group="kvstore")
        self.rt.spawn(self.expire_loads())
        log.info("kvstore %s ready (L2 %g MiB, L3 %g MiB in %s)", self.iid, self.cfg.host_cache_mb,
                 self.cfg.disk_cache_mb, self.cfg.disk_dir)

    async def serve(self) -> None:
        await self.start()
        try:
            await self.rt.run(heartbeat=self.heartbeat)
        finally:
            await self.rt.close()
            self.io.shutdown(wait=True)

    # ---- handlers ---------------------------------------------------------------------
    async def on_health(self, _req) -> bytes:
        return encode(Health(service="kvstore", instance_id=self.iid,
                             ok=not self.rt.stopping.is_set()))

    async def on_lookup(self, q: KvLookup) -> bytes:
        keys = _keys(q.keys)
        hits = await self._store(self.store.longest_prefix, keys)
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += hits
        return encode(KvLookupReply(hits=hits))

    async def on_fetch(self, q: KvFetch) -> bytes:
        blocks = await self._store(self.store.fetch_prefix, _keys(q.keys))
        self.counters["fetches"] += 1
        load_id = uuid.uuid4().hex[:16]
        if blocks:
            self.loads[load_id] = (time.monotonic(), blocks)
        first = blocks[0] if blocks else None
        return encode(KvFetchReply(load_id=load_id, instance_id=self.iid, blocks=len(blocks),
                                   layer_bytes=len(first.layers[0]) if first else 0,
                                   num_layers=len(first.layers) if first else 0))

    async def on_layer(self, req) -> None:
        p = LAYER.decode(req.data)
        entry = self.loads.get(p.load_id)
        if entry is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no open load {p.load_id}")
        blocks = entry[1]
        if not (0 <= p.b0 < p.b1 <= len(blocks)) or not 0 <= p.layer < len(blocks[0].layers):
            raise ServiceError(ErrorCode.INVALID_REQUEST, "layer or block range out of bounds")
        part = blocks[p.b0:p.b1]
        payload, headers = wire.pack_layer([b.layers[p.layer] for b in part],
                                           [b.checksums[p.layer] for b in part])
        self.counters["layer_pulls"] += 1
        if p.last:
            self.loads.pop(p.load_id, None)
            self.counters["blocks_served"] += len(blocks)
        await req.respond(payload, headers=headers)
        return None

    async def on_put(self, req) -> bytes:
        meta = KvPut.from_headers(req.headers)
        keys = _keys(meta.keys)
        try:
            blocks = wire.unpack_put(req.data, len(keys), meta.num_layers, meta.layer_bytes,
                                     meta.checksums)
        except ValueError as e:
            raise ContractError(f"KV put: {e}") from e
        good = [(keys[i], BlockData(layers, sums)) for i, layers, sums in blocks]
        await self._store(self._put_all, good)
        rejected = len(keys) - len(good)
        self.counters["puts"] += 1
        self.counters["blocks_stored"] += len(good)
        self.counters["blocks_rejected"] += rejected
        if rejected:
            log.warning("KV put: %d of %d blocks failed their checksum; not indexed",
                        rejected, len(keys))
        return encode(KvPutAck(stored=len(good), rejected=rejected))

    def _put_all(self, items) -> None:
        for k, d in items:
            self.store.put(k, d)

    async def expire_loads(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for lid, (t, _) in list(self.loads.items()):
                if now - t > self.cfg.load_ttl_s:
                    del self.loads[lid]
                    self.counters["loads_expired"] += 1

    def stats(self) -> dict:
        st = self.store.stats() | self.counters | {"open_loads": len(self.loads)}
        c = self.counters
        st["prefix_hit_rate"] = (round(c["lookup_hits"] / c["lookup_keys"], 4)
                                 if c["lookup_keys"] else 0.0)
        return st

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service="kvstore", instance_id=self.iid, ts=time.time())
