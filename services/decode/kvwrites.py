"""Decode's side of a KV write: whether it may land, judged on its header before a byte
of it is read (shared/kv/transport.receive asks admits()), then applying it.

    admits(w)              the owner check (RequestTable.granted: the request awaits its
                           KV, the attempt holds the grant, every block is in the grant)
                           and the epoch fence, on the header alone
    on_write(w, payload)   counted for its attempt, landed or not; applied only if both
                           still hold (payload None: admits() refused it); a PrefillDone
                           the write carries goes on to the service
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.contracts.common import ErrorCode
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.service import ServiceError

from .jobs import carried_done

if TYPE_CHECKING:
    from .service import DecodeService


class KvWrites:
    def __init__(self, svc: DecodeService):
        self.svc = svc      # its table, slots, reclaimer and counters, as they are now

    def admits(self, w: KvWrite) -> bool:
        svc = self.svc
        return (svc.table.granted(w.request_id, w.attempt or w.sender, w.block_ids)
                and svc.slots.fence_holds(w))

    async def on_write(self, w: KvWrite, payload) -> KvWriteAck:
        svc, attempt = self.svc, w.attempt or w.sender
        svc.table.write(w.request_id, attempt)                 # counted, landed or not
        try:
            landed = (svc.table.may_land(w.request_id, attempt, w.block_ids)
                      and payload is not None and svc.slots.write(w, payload))
        except ValueError as e:
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), w.request_id) from e
        finally:
            svc.reclaimer.release_if_settled(w.request_id)
        svc.counters["kv_writes_applied" if landed else "kv_writes_fenced"] += 1
        svc.counters["kv_bytes"] += len(payload) if landed else 0
        if w.done is not None:     # the attempt's only write: its PrefillDone rides along
            await svc.on_prefill_done(carried_done(w, landed, attempt))
        return KvWriteAck(request_id=w.request_id, seq=w.seq, applied=landed)
