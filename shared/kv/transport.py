"""The KV transport: how one prefill attempt's KV writes reach a decode instance.

In the spirit of vLLM's KVConnectorBase_V1 and SGLang's BaseKVSender/BaseKVReceiver, the
protocol above it (claims, the write ledger, reclaim-acks, epoch fences) does not care
how bytes move. A transport moves one write at a time:

    sender side   await transport.send(dest_instance, meta, payload) -> KvWriteAck
                  (raises ServiceError when decode refused the write, any other
                  exception when the write may or may not have landed: no answer)
    receiver side await transport.listen(instance_id, on_write)
                  on_write(meta, payload) -> KvWriteAck; raise ServiceError to refuse
    both          await transport.close()

Completion, polling and wait-until-idle live one level up, where the counts are: the
sender's WriteLedger (services/prefill/ledger.py, KvSender.wait_idle) and decode's request
table (services/decode/lifecycle.py). Implementations: NatsKvTransport (the default) and
InMemoryKvTransport (in-process tests: no server, no subprocess, no sleeps); faults are
wrappers (shared/kv/faults.py: SlowKvTransport). The bytes: shared/kv/wire.py.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.contracts.kv import KvWrite, KvWriteAck

OnWrite = Callable[[KvWrite, memoryview], Awaitable[KvWriteAck]]


class KvTransport(Protocol):
    max_payload: int          # largest payload one write may carry, in bytes

    async def send(self, dest: str, meta: KvWrite, payload) -> KvWriteAck: ...

    async def listen(self, instance_id: str, on_write: OnWrite) -> None: ...

    async def close(self) -> None: ...
