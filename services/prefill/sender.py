"""Sending one job attempt's KV blocks to its decode instance, with credit-based flow
control, under the write ledger.

Each write carries kv[l0:l1, :, blocks] as raw bytes (shared/kv/wire.py) over a KV
transport (shared/kv/transport.py: NATS by default); decode's ack is the credit. At most
`window` writes are unacknowledged, so the bytes queued for decode stay bounded (window x
max_payload) whatever the sender's speed. Writes are sized to the transport's max_payload
(or less).

Before each write the ledger is asked whether the attempt may still write: after a
Reclaim (or a failed write) no new write starts, and send() returns only when every
write it started has completed, so the count it leaves in the ledger is final.
"""
from __future__ import annotations

import asyncio

from shared.contracts.kv import KvWrite
from shared.contracts.messages import PrefillJob
from shared.kv import wire
from shared.kv.transport import KvTransport
from shared.service import ServiceError

from .ledger import Phase, WriteLedger


class Reclaimed(Exception):
    """The attempt was reclaimed by decode: it stopped writing."""


class KvSender:
    def __init__(self, transport: KvTransport, sender_id: str, window: int,
                 ledger: WriteLedger, max_write_bytes: int = 0):
        """max_write_bytes: 0 = the transport's max_payload. The ack timeout is the
        transport's; a slow wire for tests is shared.kv.faults.SlowKvTransport."""
        self.transport = transport
        self.sender_id = sender_id
        self.window = window
        self.ledger = ledger
        self.limit = max_write_bytes
        self.max_write_bytes = 0        # the largest payload sent so far (for STATS)
        self.changed = asyncio.Condition()   # a write of some attempt completed

    async def send(self, job: PrefillJob, engine, local_id: str, attempt: str) -> tuple[int, int]:
        """Write every prompt block; returns (writes issued, bytes). Raises Reclaimed if a
        Reclaim stopped the attempt, RuntimeError if a write failed or was refused;
        in every case only once no write of the attempt is in flight."""
        skip = job.dest.skip_blocks
        src = engine.kept_blocks(local_id)[skip:skip + len(job.dest.block_ids)]
        if len(src) != len(job.dest.block_ids):
            raise RuntimeError(f"prefill holds {len(src)} blocks, "
                               f"job wants {len(job.dest.block_ids)}")
        max_bytes = self.transport.max_payload
        if self.limit:
            max_bytes = min(max_bytes, self.limit)
        pieces = wire.plan(len(src), engine.kv, max_bytes)
        dest = job.dest.instance_id
        credits = asyncio.Semaphore(self.window)
        dtype = wire.dtype_name(engine.kv.dtype)
        ledger = self.ledger
        total = 0
        errors: list[str] = []

        async def write(p) -> None:
            nonlocal total
            async with credits:
                if not ledger.may_issue(attempt):
                    return
                payload, shape = wire.pack(engine.kv, src[p.b0:p.b1], p.l0, p.l1)
                meta = KvWrite(request_id=job.request_id, epochs=job.dest.epochs[p.b0:p.b1],
                               block_ids=job.dest.block_ids[p.b0:p.b1], layer_start=p.l0,
                               layer_end=p.l1, dtype=dtype, shape=shape,
                               checksum=wire.checksum(payload), seq=p.index, sender=self.sender_id,
                               attempt=attempt)
                ledger.issue(attempt)
                answered = False
                try:
                    ack = await self.transport.send(dest, meta, payload)
                    answered = True
                    total += len(payload)
                    self.max_write_bytes = max(self.max_write_bytes, len(payload))
                    if not ack.applied:
                        errors.append(f"decode discarded KV write {p.index} (fenced)")
                        ledger.stop(attempt)
                except ServiceError as e:    # an answer: decode refused the write
                    answered = True
                    errors.append(f"decode refused KV write {p.index}: {e}")
                    ledger.stop(attempt)
                except Exception as e:  # noqa: BLE001 - timeout, connection: may still land
                    errors.append(f"KV write {p.index}: {e!r}")
                    ledger.stop(attempt)
                finally:
                    ledger.complete(attempt, answered)
                    async with self.changed:
                        self.changed.notify_all()

        await asyncio.gather(*(write(p) for p in pieces))
        e = ledger.get(attempt)
        if e.phase is Phase.CANCELLED:
            raise Reclaimed(f"{job.request_id}: reclaimed after {e.issued} of {len(pieces)} writes")
        if errors:
            raise RuntimeError("; ".join(errors[:3]))
        return e.issued, total

    async def wait_idle(self, attempt: str) -> None:
        """Until no write of the attempt is in flight."""
        e = self.ledger.get(attempt)
        if e is None:
            return
        async with self.changed:
            await self.changed.wait_for(lambda: e.in_flight == 0)
