"""TEST ONLY: prefill's faults (faults.py) applied as wrappers when the service builds its
parts, so the job path has no fault branches:

    load_delay_s       SlowTierClient: each kvstore layer lands late (shared/kv/faults.py)
    no_load_guard      the engine is built with load_guard off (reads before ready)
    delay_before_kv_s  DelayedSender: the job's first write waits (a reclaim can land first)
    kv_write_delay_s   SlowKvTransport: each write waits once issued (a slow wire)
"""
from __future__ import annotations

import asyncio
import dataclasses

from shared.engine.config import EngineConfig
from shared.kv.faults import SlowKvTransport, SlowTierClient
from shared.kvstore_client import KvstoreClient

from .faults import PrefillFaults


def engine_config(cfg: EngineConfig, f: PrefillFaults) -> EngineConfig:
    return dataclasses.replace(cfg, load_guard=False) if f.no_load_guard else cfg


def kvstore_client(nc, timeout_s: float, f: PrefillFaults) -> KvstoreClient:
    if f.load_delay_s:
        return SlowTierClient(nc, timeout_s, max_delay_s=f.load_delay_s)
    return KvstoreClient(nc, timeout_s)


def transport(inner, f: PrefillFaults):
    return SlowKvTransport(inner, f.kv_write_delay_s) if f.kv_write_delay_s else inner


def sender(inner, f: PrefillFaults):
    return DelayedSender(inner, f.delay_before_kv_s) if f.delay_before_kv_s else inner


class DelayedSender:
    """A KvSender whose every job waits before its first write (the ledger still decides
    whether that write may start)."""

    def __init__(self, inner, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open(self, *args, **kw) -> None:
        """No layer-wise streaming: the first write waits for send()."""

    async def send(self, *args, **kw):
        await asyncio.sleep(self.delay_s)
        return await self.inner.send(*args, **kw)
