"""The engine side of kvstore: prefix lookup, layer-wise loads, asynchronous write-back.

Every call degrades to a miss: kvstore absent, restarting or slow means the engine
computes what it would have loaded, never an error for the request. Loads check every
layer block's crc32 before the layer is marked ready; a mismatch fails the load and the
engine recomputes those blocks (engine.step handles LoadFailed).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque

import torch

from shared import subjects
from shared.contracts.common import Codec, encode
from shared.contracts.kvcache import (KvFetch, KvFetchReply, KvLayerPull, KvLookup,
                                      KvLookupReply, KvPut, KvPutAck)
from shared.service import decode_reply
from services.kvstore.tiers import layer_checksum

log = logging.getLogger("pdmesh.kvcache")
LOOKUP_REPLY, FETCH_REPLY, PUT_ACK = Codec(KvLookupReply), Codec(KvFetchReply), Codec(KvPutAck)
HEADER_ROOM = 64 << 10


class KvstoreClient:
    def __init__(self, nc, timeout_s: float = 2.0, window: int = 2,
                 fault_load_delay_s: float = 0.0, seed: int | None = None):
        """fault_load_delay_s: TEST ONLY, each layer waits a random 0..delay before it
        lands (a slow tier), to show that compute never reads a layer before it is ready."""
        self.nc = nc
        self.timeout_s = timeout_s
        self.window = window
        self.fault_load_delay_s = fault_load_delay_s
        self.rng = random.Random(seed)
        self.counters = {"kv_lookups": 0, "kv_lookup_errors": 0, "kv_loads": 0,
                         "kv_load_failures": 0, "kv_load_checksum_failures": 0,
                         "kv_loaded_bytes": 0, "kv_put_blocks": 0, "kv_put_errors": 0}
        self.puts: set[asyncio.Task] = set()

    async def lookup(self, keys: list[bytes]) -> int:
        """Leading keys kvstore holds; 0 when it is absent or slow."""
        if not keys:
            return 0
        self.counters["kv_lookups"] += 1
        try:
            msg = await self.nc.request(subjects.kvstore_lookup(),
                                        encode(KvLookup(keys=[k.hex() for k in keys])),
                                        timeout=self.timeout_s)
            return decode_reply(msg.data, msg.headers, LOOKUP_REPLY).hits
        except Exception as e:  # noqa: BLE001 - no kvstore: a miss
            self.counters["kv_lookup_errors"] += 1
            log.debug("kvstore lookup failed: %r", e)
            return 0

    # ---- layer-wise load ------------------------------------------------------------------
    async def load(self, engine, ld) -> None:
        """Fill `ld` (a LayerLoad the engine returned) layer by layer; fail it on any
        problem so the engine recomputes."""
        self.counters["kv_loads"] += 1
        try:
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
        shape = (2, *kv.shape[3:])              # one layer of one block
        lb = kv[0, :, 0].numel() * kv.element_size()
        if r.layer_bytes != lb or r.num_layers != L:
            raise RuntimeError(f"kvstore blocks are {r.num_layers}x{r.layer_bytes} B, "
                               f"pool wants {L}x{lb} B")
        per = max(1, (self.nc.max_payload - HEADER_ROOM) // lb)
        n = len(ld.keys)
        pulls = [(l, b0, min(n, b0 + per)) for l in range(L) for b0 in range(0, n, per)]
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
            sums = json.loads(headers["Pdmesh-checksums"])
            if len(data) != (b1 - b0) * lb or len(sums) != b1 - b0 or any(
                    layer_checksum(data[j * lb:(j + 1) * lb]) != sums[j] for j in range(b1 - b0)):
                self.counters["kv_load_checksum_failures"] += 1
                raise RuntimeError(f"layer {l} blocks {b0}..{b1}: checksum mismatch")
            if self.fault_load_delay_s:   # TEST ONLY: a slow tier
                await asyncio.sleep(self.rng.uniform(0.0, self.fault_load_delay_s))
            t = torch.frombuffer(bytearray(data), dtype=kv.dtype).view(b1 - b0, *shape)
            if not engine.write_loaded_layer(ld, l, t.transpose(0, 1), b0):
                for t in inflight:
                    t.cancel()
                return            # the request went away
            self.counters["kv_loaded_bytes"] += len(data)
            if b1 == n:
                ld.layer_done(l)

    # ---- write-back -------------------------------------------------------------------------
    def write_back(self, engine, blocks: list[int], keys: list[bytes]) -> None:
        """Copy these complete blocks now (the caller still holds them) and send them to
        kvstore in the background; the request never waits for it."""
        if not blocks:
            return
        with engine.lock:
            ids = torch.tensor(blocks, dtype=torch.long)
            # [L, 2, n, BS, H, D] -> [n, L, 2, BS, H, D]: each block's layers in order
            snap = engine.kv[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous()
        task = asyncio.ensure_future(self._put(snap, keys))
        self.puts.add(task)
        task.add_done_callback(self.puts.discard)

    async def _put(self, snap: torch.Tensor, keys: list[bytes]) -> None:
        n, L = snap.shape[0], snap.shape[1]
        raw = snap.view(torch.uint8).numpy()
        lb = raw[0, 0].nbytes
        per = max(1, (self.nc.max_payload - HEADER_ROOM) // (L * lb))
        for b0 in range(0, n, per):
            b1 = min(n, b0 + per)
            payload = raw[b0:b1].tobytes()
            sums = [[layer_checksum(payload[((i - b0) * L + l) * lb:((i - b0) * L + l + 1) * lb])
                     for l in range(L)] for i in range(b0, b1)]
            meta = KvPut(keys=[k.hex() for k in keys[b0:b1]], num_layers=L, layer_bytes=lb,
                         checksums=sums)
            try:
                m = await self.nc.request(subjects.kvstore_put(), payload, timeout=self.timeout_s * 5,
                                          headers=meta.headers())
                decode_reply(m.data, m.headers, PUT_ACK)
                self.counters["kv_put_blocks"] += b1 - b0
            except Exception as e:  # noqa: BLE001 - a lost write-back is a future miss
                self.counters["kv_put_errors"] += 1
                log.debug("kvstore put failed: %r", e)
                return
