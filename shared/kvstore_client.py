"""The engine side of kvstore: prefix lookup, layer-wise loads, asynchronous write-back.

Every call degrades to a miss: kvstore absent, restarting or slow means the engine
computes what it would have loaded, never an error for the request. Loads check every
layer block's crc32 before the layer is marked ready; a mismatch fails the load and the
engine recomputes those blocks (engine.step handles LoadFailed).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from shared import subjects, tracing
from shared.contracts.common import Codec, encode
from shared.contracts.kvcache import (
    KvFetch,
    KvFetchReply,
    KvLayerPull,
    KvLookup,
    KvLookupReply,
    KvPut,
    KvPutAck,
)
from shared.kv import wire
from shared.kv.silence import Silence
from shared.service import decode_reply

log = logging.getLogger("pdmesh.kvcache")
LOOKUP_REPLY, FETCH_REPLY, PUT_ACK = Codec(KvLookupReply), Codec(KvFetchReply), Codec(KvPutAck)


class KvstoreClient:
    """A slow tier for tests: shared.kv.faults.SlowTierClient (overrides land())."""

    def __init__(self, nc, timeout_s: float = 2.0, window: int = 2):
        self.nc = nc
        self.timeout_s = timeout_s
        self.window = window
        self.counters = {"kv_lookups": 0, "kv_lookup_errors": 0, "kv_loads": 0,
                         "kv_load_failures": 0, "kv_load_checksum_failures": 0,
                         "kv_loaded_bytes": 0, "kv_put_blocks": 0, "kv_put_errors": 0,
                         "kv_lookups_skipped": 0, "kv_puts_skipped": 0}
        self.puts: set[asyncio.Task] = set()
        self.silence = Silence()      # lookups timed out: skip them (and write-backs) a while

    async def follow_heartbeats(self) -> None:
        """kvstore's heartbeat ends a silence at once: restarted or thawed, it is asked
        again within a second instead of at the next probe (before, the write-backs
        skipped meanwhile left a restarted kvstore empty)."""
        async def heard(_msg) -> None:
            if self.silence.silent:
                log.info("kvstore heartbeats again: lookups and write-backs go to it")
                self.silence.answered()
        await self.nc.subscribe(subjects.heartbeat("kvstore"), cb=heard)

    async def lookup(self, keys: list[bytes]) -> int:
        """Leading keys kvstore holds; 0 when it is absent or slow (silent: at once)."""
        if not keys:
            return 0
        if not self.silence.may_ask(time.monotonic()):
            self.counters["kv_lookups_skipped"] += 1
            return 0
        self.counters["kv_lookups"] += 1
        try:
            with tracing.span("cache_lookup", kind="CLIENT", keys=len(keys)):
                msg = await self.nc.request(subjects.kvstore_lookup(),
                                            encode(KvLookup(keys=[k.hex() for k in keys])),
                                            timeout=self.timeout_s)
        except asyncio.TimeoutError:
            if not self.silence.silent:
                log.warning("kvstore did not answer a lookup within %gs: lookups miss at "
                            "once while it is silent (one probe every %gs)", self.timeout_s,
                            self.silence.probe_s)
            self.silence.timed_out(time.monotonic())
            self.counters["kv_lookup_errors"] += 1
            return 0
        except Exception as e:  # noqa: BLE001 - no kvstore: a miss
            self.counters["kv_lookup_errors"] += 1
            log.debug("kvstore lookup failed: %r", e)
            return 0
        if self.silence.silent:
            log.info("kvstore answers lookups again")
        self.silence.answered()
        try:
            return decode_reply(msg.data, msg.headers, LOOKUP_REPLY).hits
        except Exception as e:  # noqa: BLE001 - an error reply: a miss
            self.counters["kv_lookup_errors"] += 1
            log.debug("kvstore lookup failed: %r", e)
            return 0

    # ---- layer-wise load ------------------------------------------------------------------
    async def load(self, engine, ld) -> None:
        """Fill `ld` (a LayerLoad the engine returned) layer by layer; fail it on any
        problem so the engine recomputes."""
        self.counters["kv_loads"] += 1
        try:
            with tracing.span("cache_load", kind="CLIENT", blocks=len(ld.keys)):
                await self._load(engine, ld)
        except Exception as e:  # noqa: BLE001 - any failure: the engine recomputes
            self.counters["kv_load_failures"] += 1
            log.info("%s: KV load failed (%r); recomputing", ld.request_id, e)
            ld.fail(repr(e))

    async def _load(self, engine, ld) -> None:
        msg = await self.nc.request(subjects.kvstore_fetch(),
                                    encode(KvFetch(keys=[k.hex() for k in ld.keys])),
                                    timeout=self.timeout_s)
        r = decode_reply(msg.data, msg.headers, FETCH_REPLY)
        if r.blocks < len(ld.keys):
            raise RuntimeError(f"kvstore holds {r.blocks} of {len(ld.keys)} blocks now")
        kv = engine.kv
        L = kv.shape[0]
        lb = wire.layer_bytes(kv)
        if r.layer_bytes != lb or r.num_layers != L:
            raise RuntimeError(f"kvstore blocks are {r.num_layers}x{r.layer_bytes} B, "
                               f"pool wants {L}x{lb} B")
        n = len(ld.keys)
        pulls = wire.plan_pulls(n, L, lb, self.nc.max_payload - wire.HEADER_ROOM)
        subject = subjects.kvstore_layer(r.instance_id)

        async def pull(i: int):
            l, b0, b1 = pulls[i]
            p = KvLayerPull(load_id=r.load_id, layer=l, b0=b0, b1=b1, last=i == len(pulls) - 1)
            m = await self.nc.request(subject, encode(p), timeout=self.timeout_s)
            return decode_reply(m.data, m.headers, None) if m.headers and m.headers.get(
                "Nats-Service-Error-Code") else (m.data, m.headers)

        inflight: deque[asyncio.Task] = deque()
        nxt = 0
        for i, (l, b0, b1) in enumerate(pulls):
            while nxt < len(pulls) and len(inflight) < self.window:
                inflight.append(asyncio.ensure_future(pull(nxt)))
                nxt += 1
            try:
                data, headers = await inflight.popleft()
            except BaseException:
                for t in inflight:
                    t.cancel()
                raise
            try:
                t = wire.unpack_layer(data, headers, kv, b1 - b0)
            except wire.ChecksumError:
                self.counters["kv_load_checksum_failures"] += 1
                raise RuntimeError(f"layer {l} blocks {b0}..{b1}: checksum mismatch") from None
            if not await self.land(engine, ld, l, t, b0):
                for task in inflight:
                    task.cancel()
                return            # the request went away
            self.counters["kv_loaded_bytes"] += len(data)
            if b1 == n:
                ld.layer_done(l)

    async def land(self, engine, ld, layer: int, tensor, b0: int) -> bool:
        """Write one verified layer of blocks b0.. into the engine (tensor [2, n, BS, Hkv,
        D]); False when the request went away. The hook a slow tier overrides."""
        return engine.write_loaded_layer(ld, layer, tensor, b0)

    # ---- write-back -------------------------------------------------------------------------
    def write_back(self, engine, blocks: list[int], keys: list[bytes]) -> None:
        """Copy these complete blocks now (the caller still holds them) and send them to
        kvstore in the background; the request never waits for it."""
        if not blocks:
            return
        if self.silence.silent:       # would wait out its timeout, its snapshot held
            self.counters["kv_puts_skipped"] += 1
            return
        snap = engine.port.snapshot(blocks, wire.snapshot_blocks)   # each block's layers in order
        task = asyncio.ensure_future(self._put(snap, keys))
        self.puts.add(task)
        task.add_done_callback(self.puts.discard)

    async def _put(self, snap, keys: list[bytes]) -> None:
        n, L = snap.shape[0], snap.shape[1]
        lb = snap[0, 0].numel() * snap.element_size()
        for b0, b1 in wire.plan_puts(n, L, lb, self.nc.max_payload - wire.HEADER_ROOM):
            payload, sums = wire.pack_put(snap, b0, b1)
            meta = KvPut(keys=[k.hex() for k in keys[b0:b1]], num_layers=L, layer_bytes=lb,
                         checksums=sums)
            try:
                m = await self.nc.request(subjects.kvstore_put(), payload,
                                          timeout=self.timeout_s * 5, headers=meta.headers())
                decode_reply(m.data, m.headers, PUT_ACK)
                self.counters["kv_put_blocks"] += b1 - b0
            except Exception as e:  # noqa: BLE001 - a lost write-back is a future miss
                self.counters["kv_put_errors"] += 1
                log.debug("kvstore put failed: %r", e)
                return
