"""Aborts, fallbacks and reclaims: every way a request leaves decode's KV slots.

Every abort (gateway Abort: client gone, timeout, explicit; decode shutdown; an anomaly;
a failed start) and every fallback (a failed or silent prefill, whose request is then
prefilled here in fresh blocks) goes through the request table (lifecycle.py): blocks
that a claimed attempt may still write are quarantined, the attempt is sent a Reclaim,
and the blocks return to the pool only when its ReclaimAck's writes have all arrived, or
when the lease ends (invariant 3).
"""
from __future__ import annotations

import asyncio
import logging
import time

from shared.contracts.messages import AbortReason, Path
from shared.contracts.reclaim import Reclaim

from .lifecycle import Plan, RequestTable
from .peers import DecodePeers
from .request import DecodeRequest, Outcome
from .slots import KvSlots

log = logging.getLogger("pdmesh.decode")
SWEEP_S = 0.1


class Reclaimer:
    def __init__(self, iid: str, table: RequestTable, slots: KvSlots, peers: DecodePeers,
                 spawn, reclaim_timeout_s: float, forget=lambda rid: None,
                 wake=lambda: None):
        self.iid = iid
        self.table = table
        self.slots = slots
        self.peers = peers
        self.spawn = spawn                 # start a background task
        self.timeout_s = reclaim_timeout_s
        self.forget = forget               # drop per-request state elsewhere (the monitor)
        self.wake = wake                   # the engine loop: there is work (it may be asleep)
        self.fallbacks = 0

    def abort(self, rid: str, reason) -> DecodeRequest | None:
        """The request leaves the batch; blocks a prefill may still write are quarantined
        and their writers asked to stop. Returns the record if the request was live."""
        r = self.table.get(rid)
        r = r if r is not None and r.live else None
        self.forget(rid)
        plan = self.table.abort(rid, reason, time.monotonic())
        if plan is Plan.QUARANTINE:
            self.slots.drop(rid, keep_blocks=True)
            self.ask_owners()
        elif plan in (Plan.FREE, Plan.ENGINE):
            self.slots.engine.abort(rid)
        return r

    def fallback(self, rid: str, reason) -> None:
        """Prefill here, in fresh blocks; the reserved ones are reclaimed like an abort's."""
        plan = self.table.fallback(rid, reason, time.monotonic())
        self.slots.fallback(rid, keep_blocks=plan is Plan.QUARANTINE)
        self.table.get(rid).path = Path.COLOCATED
        self.fallbacks += 1
        self.wake()          # the sweep may be the only thing awake: nothing else would
        if plan is Plan.QUARANTINE:
            self.ask_owners()

    def release(self, rid: str, outcome: Outcome) -> None:
        """The quarantine ends: its blocks go back to the pool."""
        self.slots.release(self.table.reclaimed(rid, outcome, time.monotonic()))
        self.wake()          # freed blocks: a request waiting for them may now run
        if outcome is Outcome.LEASE:
            log.warning("%s: no reclaim answer within %.1fs; blocks freed (epoch-fenced)", rid,
                        self.table.lease_s)

    def release_if_settled(self, rid: str) -> None:
        if self.table.settled(rid):
            self.release(rid, Outcome.ACKED)

    def ask_owners(self) -> None:
        for rid, attempt, instance in self.table.to_ask(time.monotonic()):
            self.spawn(self.send_reclaim(rid, attempt, instance))

    async def send_reclaim(self, rid: str, attempt: str, instance: str) -> None:
        r = self.table.get(rid)
        reason = r.quarantine.reason if r is not None and r.quarantine else ""
        msg = Reclaim(request_id=rid, attempt=attempt, decode_instance=self.iid, reason=reason)
        try:
            ack = await self.peers.reclaim(instance, msg, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - asked again after reclaim_timeout_s, or the lease ends it
            log.debug("%s: reclaim of %s on %s unanswered: %r", rid, attempt, instance, e)
            return
        self.table.reclaim_ack(rid, ack.attempt, ack.owner, ack.writes_issued)
        self.release_if_settled(rid)

    def sweep(self, now: float) -> None:
        """Quarantines whose writers answered (or whose lease ran out) end; silent
        writers are asked again."""
        for rid, outcome in self.table.ready(now):
            self.release(rid, outcome)
        self.ask_owners()

    async def run(self, prefill_timeout_s: float) -> None:
        """Forever: sweep, and prefill here what waited too long for its KV."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            self.sweep(now)
            for r in list(self.table.live()):
                if r.wants_kv and now - r.submitted > prefill_timeout_s:
                    log.warning("%s: no KV after %.0fs; prefilling locally", r.request_id,
                                now - r.submitted)
                    self.fallback(r.request_id, AbortReason.PREFILL_TIMEOUT)
