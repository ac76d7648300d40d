"""Sending one job's KV blocks to its decode instance, with credit-based flow control.

Each write is a NATS request carrying kv[l0:l1, :, blocks] as raw bytes (metadata in
headers); decode's reply is the credit. At most `window` writes are unacknowledged, so
the bytes queued for decode at the server stay bounded (window x max_payload) whatever
the sender's speed. Messages are sized to the server's max_payload.
"""
from __future__ import annotations

import asyncio

from shared import subjects
from shared.contracts.kv import KvWrite, KvWriteAck, checksum
from shared.contracts.messages import PrefillJob
from shared.engine.kv_transfer import DTYPE_NAMES, pack, plan
from shared.service import decode_reply
from shared.contracts.common import Codec

HEADER_ROOM = 4096
ACK = Codec(KvWriteAck)


class KvSender:
    def __init__(self, nc, sender_id: str, window: int, ack_timeout_s: float):
        self.nc = nc
        self.sender_id = sender_id
        self.window = window
        self.ack_timeout_s = ack_timeout_s
        self.max_write_bytes = 0        # the largest payload sent so far (for STATS)

    async def send(self, job: PrefillJob, engine, local_id: str) -> tuple[int, int]:
        """Write every prompt block; returns (writes issued, bytes). Raises on any
        write that is not acknowledged."""
        src = engine.kept_blocks(local_id)[:len(job.dest.block_ids)]
        if len(src) != len(job.dest.block_ids):
            raise RuntimeError(f"prefill holds {len(src)} blocks, job wants {len(job.dest.block_ids)}")
        max_bytes = self.nc.max_payload - HEADER_ROOM
        pieces = plan(len(src), engine.kv, max_bytes)
        subject = subjects.decode_kv(job.dest.instance_id)
        credits = asyncio.Semaphore(self.window)
        dtype = DTYPE_NAMES[engine.kv.dtype]
        total = 0

        async def write(p) -> None:
            nonlocal total
            async with credits:
                payload, shape = pack(engine.kv, src[p.b0:p.b1], p.l0, p.l1)
                meta = KvWrite(request_id=job.request_id, epochs=job.dest.epochs[p.b0:p.b1],
                               block_ids=job.dest.block_ids[p.b0:p.b1], layer_start=p.l0,
                               layer_end=p.l1, dtype=dtype, shape=shape,
                               checksum=checksum(payload), seq=p.index, sender=self.sender_id)
                msg = await self.nc.request(subject, payload, timeout=self.ack_timeout_s,
                                            headers=meta.headers())
                ack = decode_reply(msg.data, msg.headers, ACK)
                total += len(payload)
                self.max_write_bytes = max(self.max_write_bytes, len(payload))
                if not ack.applied:
                    raise RuntimeError(f"decode discarded KV write {p.index} (request gone or fenced)")

        tasks = [asyncio.ensure_future(write(p)) for p in pieces]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return len(pieces), total

