"""LayerSplit: a prefill group whose ranks each keep only their layers of the group's
shared prefix cache, and send a layer to the rank computing a request just before its
attention reads it.

    lookup(keys)        how many leading blocks the group holds (this rank's copy of the
                        group index; no I/O)
    load(engine, ld)    fill a LayerLoad the engine returned for a group hit: own layers
                        from this rank's shard, the others fetched from their owners with
                        `prefetch_layers` requests in flight, each marked ready as it lands
                        (Model.forward waits on layer l just before its attention)
    insert(engine, ..)  after a job: snapshot the prompt blocks the group lacks, keep my
                        layers, send every other rank its layers (background thread)

A rank that dies takes its layers with it: the others leave the group (membership.py),
drop every entry and compute what they would have loaded; loads in flight fail and the
engine recomputes those blocks. A restarted rank bumps the generation and the group
re-forms with an empty index.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch

from .comm import Wire
from .config import LayerSplitConfig
from .membership import Membership
from .shard import ShardStore, owner

log = logging.getLogger("pdmesh.layersplit")


class LayerSplitGroup:
    def __init__(self, cfg: LayerSplitConfig, engine, delay_s: float = 0.0):
        """delay_s: TEST ONLY, each remote layer lands this much later (a slow wire)."""
        self.cfg, self.engine, self.delay_s = cfg, engine, delay_s
        kv = engine.kv                         # [L, 2, blocks, BS, Hkv, D]
        self.num_layers = kv.shape[0]
        self.block_shape = tuple(kv.shape[3:])
        self.shard = ShardStore(cfg.size, cfg.rank, self.num_layers, self.block_shape, kv.dtype,
                                int(cfg.cache_mb * (1 << 20)))
        self.wire: Wire | None = None
        self.members = Membership(cfg, self._joined, self._lost) if cfg.size > 1 else None
        self.inserts: queue.Queue = queue.Queue(maxsize=64)
        self.counters = {"group_loads": 0, "group_load_failures": 0, "group_loaded_blocks": 0,
                         "group_wait_s": 0.0, "group_transfer_s": 0.0,
                         "group_inserts_dropped": 0}
        self.wait_per_layer = [0.0] * self.num_layers     # compute time waited per layer
        self.last_load: dict = {}

    @property
    def ready(self) -> bool:
        return self.cfg.size == 1 or self.wire is not None

    def start(self) -> None:
        threading.Thread(target=self._insert_loop, name="layersplit-insert", daemon=True).start()
        if self.members is not None:
            self.members.start()

    def stop(self) -> None:
        if self.members is not None:
            self.members.stop()
        self._lost("stopping")

    def _joined(self, gen: int, pg, store) -> None:
        self.shard.clear()
        wire = Wire(pg, self.cfg.rank, store, self.block_shape, self.engine.kv.dtype,
                    self.cfg.timeout_s)
        threading.Thread(target=wire.serve, args=(self.shard, self.members.fail),
                         name=f"layersplit-serve-{gen}", daemon=True).start()
        self.wire = wire

    def _lost(self, reason: str) -> None:
        wire, self.wire = self.wire, None
        if wire is not None:
            wire.closed = True
            self._fold(wire)
        n = self.shard.clear()
        if n:
            log.warning("layersplit: %d cached blocks lost (%s)", n, reason)

    def _fold(self, wire: Wire) -> None:
        for k, v in wire.counters.items():
            self.counters[k] = self.counters.get(k, 0) + v
        wire.counters = dict.fromkeys(wire.counters, 0)

    # ---- lookups and loads ------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        if not self.ready or not keys:
            return 0
        return len(self.shard.match(keys))

    async def load(self, engine, ld) -> None:
        """Fill `ld` layer by layer (a worker thread; the engine computes meanwhile); on any
        problem fail it so the engine recomputes those blocks."""
        self.counters["group_loads"] += 1
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._load, engine, ld)
        except Exception as e:  # noqa: BLE001 - a peer died, a slot was reused: recompute
            self.counters["group_load_failures"] += 1
            log.info("%s: group load failed (%r); recomputing", ld.request_id, e)
            if self.members is not None and "slot" not in str(e):
                self.members.fail(repr(e))
            ld.fail(repr(e))
            return
        self._account(ld)

    def _load(self, engine, ld) -> None:
        keys = ld.keys
        slots = self.shard.match(keys)
        if len(slots) < len(keys):
            raise RuntimeError(f"the group holds {len(slots)} of {len(keys)} blocks now (slot)")
        wire, t0 = self.wire, time.monotonic()
        if wire is None and len(self.shard.owned) < self.num_layers:
            raise RuntimeError("no group")
        pending: list = []
        for layer in range(self.num_layers):       # in compute order: mine land at once,
            if layer in self.shard.local:          # the others are requested, a window ahead
                self._land(engine, ld, layer, self.shard.gather(layer, slots, keys))
                continue
            if len(pending) >= self.cfg.prefetch_layers:
                self._finish(engine, ld, wire, *pending.pop(0))
            pending.append((layer, wire.fetch(owner(layer, self.cfg.size), layer, slots, keys)))
        for layer, handle in pending:
            self._finish(engine, ld, wire, layer, handle)
        self.counters["group_transfer_s"] += time.monotonic() - t0

    def _finish(self, engine, ld, wire: Wire, layer: int, handle) -> None:
        data = wire.finish(handle)
        if self.delay_s:
            time.sleep(self.delay_s)
        self._land(engine, ld, layer, data)

    @staticmethod
    def _land(engine, ld, layer: int, data) -> None:
        if data is None:
            raise RuntimeError(f"layer {layer}: a slot no longer holds its block")
        if engine.write_loaded_layer(ld, layer, data):
            ld.layer_done(layer)

    def _account(self, ld) -> None:
        self.counters["group_loaded_blocks"] += len(ld.blocks)
        for layer, a, b in list(ld.waits):
            self.wait_per_layer[layer] += b - a
            self.counters["group_wait_s"] += b - a
        self.last_load = ld.timeline()

    # ---- inserts --------------------------------------------------------------------------
    def insert(self, engine, blocks: list[int], keys: list[bytes]) -> None:
        """The job's prompt blocks (still held by the caller) under their keys: those the
        group lacks are snapshot now and distributed in the background."""
        if not self.ready or not keys:
            return
        todo = self.shard.missing(keys)
        if not todo:
            return
        snap = engine.port.snapshot([blocks[i] for i in todo])   # [L, 2, n, BS, Hkv, D]
        try:
            self.inserts.put_nowait(([keys[i] for i in todo], snap))
        except queue.Full:
            self.counters["group_inserts_dropped"] += 1

    def _insert_loop(self) -> None:
        while True:
            keys, snap = self.inserts.get()
            try:
                self._distribute(keys, snap)
            except Exception as e:  # noqa: BLE001 - a peer died: the group re-forms
                log.info("group insert failed: %r", e)
                if self.members is not None:
                    self.members.fail(repr(e))
            finally:
                self.inserts.task_done()

    def _distribute(self, keys: list[bytes], snap: torch.Tensor) -> None:
        wire = self.wire
        if not self.ready:
            return
        slots = self.shard.allocate(len(keys))
        keys, snap = keys[:len(slots)], snap[:, :, :len(slots)]
        size = self.cfg.size
        for r in range(size):
            layers = [layer for layer in range(self.num_layers) if owner(layer, size) == r]
            data = snap[layers] if layers else None
            if r == self.cfg.rank:
                self.shard.put(slots, keys, data)
            else:
                wire.insert(r, slots, keys, data)

    # ---- observability ----------------------------------------------------------------------
    def stats(self) -> dict:
        wire = self.wire.counters if self.wire is not None else {}
        out = dict(self.counters)
        for k, v in wire.items():
            out[k] = out.get(k, 0) + v
        moved = out["group_transfer_s"]
        hidden = 1 - out["group_wait_s"] / moved if moved > 0 else 0.0
        members = self.members.counters if self.members is not None else {}
        return {"group_size": self.cfg.size, "group_rank": self.cfg.rank,
                "group_ready": self.ready, **self.shard.stats(), **out, **members,
                "group_hidden_share": round(max(0.0, hidden), 4),
                "group_wait_per_layer_s": [round(w, 6) for w in self.wait_per_layer],
                "group_last_load": self.last_load}
