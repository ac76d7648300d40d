"""Everything decode sends to other services, behind one small interface: token chunks to
a gateway, prefill jobs to the work queue, reclaims to a prefill attempt, anomaly events.
NatsDecodePeers is the real one; in-process tests (tests/decode) route them in memory."""
from __future__ import annotations

from typing import Protocol

from shared import subjects
from shared.contracts.common import Codec, encode
from shared.contracts.messages import AnomalyEvent, PrefillJob, TokenChunk
from shared.contracts.reclaim import Reclaim, ReclaimAck
from shared.jobqueue import publish_job
from shared.service import decode_reply

RECLAIM_ACK = Codec(ReclaimAck)


class DecodePeers(Protocol):
    async def send_chunk(self, subject: str, chunk: TokenChunk) -> None: ...

    async def queue_job(self, job: PrefillJob) -> None: ...

    async def reclaim(self, instance: str, msg: Reclaim, timeout: float) -> ReclaimAck: ...

    async def anomaly(self, ev: AnomalyEvent) -> None: ...


class NatsDecodePeers:
    def __init__(self, nc, js):
        self.nc = nc
        self.js = js

    async def send_chunk(self, subject: str, chunk: TokenChunk) -> None:
        await self.nc.publish(subject, encode(chunk))

    async def queue_job(self, job: PrefillJob) -> None:
        """On the JetStream work queue (re-created if its store was lost; one copy per
        request and attempt however many tries reached it)."""
        await publish_job(self.js, encode(job), msg_id=f"{job.request_id}:{job.dest.epochs[:1]}")

    async def reclaim(self, instance: str, msg: Reclaim, timeout: float) -> ReclaimAck:
        reply = await self.nc.request(subjects.prefill_reclaim(instance), encode(msg),
                                      timeout=timeout)
        return decode_reply(reply.data, reply.headers, RECLAIM_ACK)

    async def anomaly(self, ev: AnomalyEvent) -> None:
        await self.nc.publish(subjects.request_anomaly(), encode(ev))
