"""TEST ONLY fault injection for the KV wires, as wrappers: the code under test has no
`if fault` branches, a faulty part is built in its place (services' start(), tests).

  SlowKvTransport   each KV write waits a random 0..max_delay_s once issued (a slow wire)
  SlowTierClient    each layer loaded from kvstore lands a random 0..max_delay_s late
                    (a slow tier: compute must still never read a layer before it landed)
"""
from __future__ import annotations

import asyncio
import random

from shared.contracts.kv import KvWrite, KvWriteAck
from shared.kvstore_client import KvstoreClient

from .transport import KvTransport, OnWrite
from .wire import Buffer


class SlowKvTransport:
    def __init__(self, inner: KvTransport, max_delay_s: float, seed: int | None = None):
        self.inner = inner
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)

    @property
    def max_payload(self) -> int:
        return self.inner.max_payload

    def __getattr__(self, name):     # alloc, same_host, counters: the wrapped transport's
        return getattr(self.inner, name)

    async def send(self, dest: str, meta: KvWrite, payload: Buffer) -> KvWriteAck:
        await asyncio.sleep(self.rng.uniform(0.0, self.max_delay_s))
        return await self.inner.send(dest, meta, payload)

    async def listen(self, instance_id: str, on_write: OnWrite, admit=None) -> None:
        await self.inner.listen(instance_id, on_write, admit)

    async def close(self) -> None:
        await self.inner.close()


class SlowTierClient(KvstoreClient):
    def __init__(self, nc, timeout_s: float = 2.0, max_delay_s: float = 0.0,
                 seed: int | None = None, **kw):
        super().__init__(nc, timeout_s, **kw)
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)

    async def land(self, engine, ld, layer: int, tensor, b0: int) -> bool:
        await asyncio.sleep(self.rng.uniform(0.0, self.max_delay_s))
        return await super().land(engine, ld, layer, tensor, b0)
