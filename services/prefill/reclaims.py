"""Prefill's side of invariant 3: answering decode's Reclaim.

A Reclaim cancels the attempt in the write ledger (no write starts after it); the
ReclaimAck, with the count of writes the attempt issued, goes back once every write in
flight has completed. An attempt this process does not know (it restarted, or never ran
it) is answered owner=False: decode then waits for the lease."""
from __future__ import annotations

import asyncio
import logging
import time

from shared.contracts.common import Codec, encode
from shared.contracts.reclaim import Reclaim, ReclaimAck

from .ledger import WriteLedger

log = logging.getLogger("pdmesh.prefill")
RECLAIM = Codec(Reclaim)
REAP_S = 5.0


class ReclaimResponder:
    def __init__(self, iid: str, ledger: WriteLedger, sender, spawn):
        self.iid = iid
        self.ledger = ledger
        self.sender = sender              # KvSender: wait_idle(attempt)
        self.spawn = spawn
        self.answered = 0

    async def on_reclaim(self, req) -> None:
        """Cancel the attempt; answer once its writes in flight have completed."""
        r = RECLAIM.decode(req.data)
        e = self.ledger.cancel(r.attempt)
        if e is None or e.request_id != r.request_id:
            await req.respond(encode(ReclaimAck(request_id=r.request_id, attempt=r.attempt,
                                                prefill_instance=self.iid, owner=False)))
            return None
        self.spawn(self.answer(req, r.attempt))
        return None

    async def answer(self, req, attempt: str) -> None:
        await self.sender.wait_idle(attempt)
        e = self.ledger.get(attempt)
        self.answered += 1
        try:
            await req.respond(encode(ReclaimAck(
                request_id=e.request_id, attempt=attempt, prefill_instance=self.iid, owner=True,
                writes_issued=e.issued, writes_completed=e.completed, writes_failed=e.failed)))
        except Exception as ex:  # noqa: BLE001 - decode asks again, or its lease ends it
            log.debug("%s: ReclaimAck not sent: %r", e.request_id, ex)

    async def reap(self) -> None:
        """Forever: forget attempts closed long ago."""
        while True:
            await asyncio.sleep(REAP_S)
            self.ledger.reap(time.monotonic())
