"""Decode's request table: pure bookkeeping of every request's record (request.py), of
who may still write a request's KV blocks, and of when those blocks may be reused
(invariant 3). No I/O, no clock of its own: the service feeds it events and carries out
what it answers.

Reclaim of a reservation (abort while ALLOCATED / AWAITING_KV, or a fallback):
  - no owner yet: nobody was allowed to write, and no claim is granted from now on (the
    request no longer awaits KV), so the blocks are free at once;
  - else the blocks are quarantined and every owner attempt is asked to stop (Reclaim).
    An owner's ReclaimAck (or its PrefillDone) gives the final count of writes it issued;
    the reservation is reclaimed once every owner has given its count and that many of
    its writes have been received here (landed or fenced), or once the lease runs out
    (dead or partitioned prefill: the epoch fence keeps a late write out of reused blocks).

A job redelivered after a prefill crash is a new attempt: it claims again and is granted
only while the request still awaits its KV (as a second owner), else refused before it
computes anything. KV writes are counted per attempt while the request holds its
reservation (awaiting or quarantined), landed or fenced alike, so a count given later can
be checked against them; writes for anything else are counted as stray.

Test-only guard switch: reclaim_ack=False is the unprotected system: every claim is
granted and aborted blocks are freed at once (the epoch fence is then the only guard).
"""
from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator

from .request import DecodeRequest, KvGrant, Outcome, Quarantine, RequestStatus


class Plan(str, enum.Enum):
    """What the service does with an aborted request's blocks."""
    UNKNOWN = "unknown"          # not (or no longer) a live request: nothing
    ENGINE = "engine"            # running: the engine frees its blocks
    FREE = "free"                # reserved, nobody may write: free now
    QUARANTINE = "quarantine"    # reserved, owners may write: quarantine and reclaim


class Next(str, enum.Enum):
    """What a PrefillDone means for its request."""
    IGNORE = "ignore"            # late, duplicate, or for a reservation being reclaimed
    START = "start"              # all KV in: join the batch with the first token
    FALLBACK = "fallback"        # prefill failed or writes are missing: prefill locally


RECENT = 4096     # finished requests remembered for a late acknowledgement


class RequestTable:
    def __init__(self, lease_s: float, retry_s: float = 1.0, reclaim_ack: bool = True,
                 keep_latencies: int = 20_000):
        self.lease_s = lease_s
        self.retry_s = retry_s
        self.ack_enabled = reclaim_ack
        self.records: dict[str, DecodeRequest] = {}
        self.aborts: Counter = Counter()          # reason -> aborts
        self.reclaims: Counter = Counter()        # Outcome value -> reclaims
        self.claims: Counter = Counter()          # granted / refused
        self.stray_writes = 0                     # writes for no known reservation
        self.foreign_writes = 0                   # refused by the owner check
        self.quarantined_writes = 0               # writes that landed on a quarantine: the
        #                                           hazard the reclaim-ack waits out
        # quarantine -> free, seconds (immediate frees are counted in reclaims only)
        self.latencies: deque[float] = deque(maxlen=keep_latencies)
        # requests that finished (not aborted) lately, with their path: one can finish
        # before its submission is acknowledged (a fast prefill, max_tokens 1)
        self.recently_finished: OrderedDict[str, object] = OrderedDict()

    # ---- admission ------------------------------------------------------------------
    def admit_remote(self, rid: str, block_ids: list[int], epochs: list[int],
                     held: list[int] | None = None, **fields) -> DecodeRequest:
        grant = KvGrant(list(block_ids), list(epochs),
                        list(block_ids if held is None else held))
        return self._new(DecodeRequest(rid, RequestStatus.ALLOCATED, grant=grant, **fields))

    def admit_local(self, rid: str, **fields) -> DecodeRequest:
        return self._new(DecodeRequest(rid, RequestStatus.RUNNING, **fields))

    def _new(self, r: DecodeRequest) -> DecodeRequest:
        if r.request_id in self.records:
            raise ValueError(f"request {r.request_id!r} is already known")
        self.records[r.request_id] = r
        return r

    def queued(self, rid: str) -> None:
        """The PrefillJob is on the work queue."""
        r = self.records.get(rid)
        if r is not None and r.status is RequestStatus.ALLOCATED:
            r.status = RequestStatus.AWAITING_KV

    def get(self, rid: str) -> DecodeRequest | None:
        return self.records.get(rid)

    def state(self, rid: str) -> RequestStatus | None:
        r = self.records.get(rid)
        return r.status if r is not None else None

    def live(self) -> Iterator[DecodeRequest]:
        return (r for r in list(self.records.values()) if r.live)

    def awaiting_kv(self) -> int:
        """Requests whose KV is still coming (stats()' awaiting_kv, without its latency
        percentiles: asked on every submission)."""
        return sum(1 for r in self.records.values() if r.wants_kv)

    # ---- prefill side events --------------------------------------------------------
    def claim(self, rid: str, attempt: str, instance: str, block_ids: list[int],
              epochs: list[int]) -> tuple[bool, str]:
        """May this attempt write the request's blocks? Granted only while the request
        still wants its KV and the claim names the reservation decode made."""
        ok, why = self._claim(self.records.get(rid), attempt, instance, block_ids, epochs)
        self.claims["granted" if ok else "refused"] += 1
        return ok, why

    def _claim(self, r, attempt, instance, block_ids, epochs) -> tuple[bool, str]:
        if not self.ack_enabled:      # TEST ONLY: the unprotected system lets anyone write
            if r is not None and r.grant is not None:
                r.grant.owners[attempt] = instance
            return True, ""
        if r is None:
            return False, "unknown request"
        if r.status is RequestStatus.ABORTING:
            return False, "aborted"
        if not r.wants_kv:
            return False, f"request is {r.status.value}"
        if r.grant.block_ids != list(block_ids) or r.grant.epochs != list(epochs):
            return False, "claim names another reservation"
        r.grant.owners[attempt] = instance
        return True, ""

    def _grant_of(self, rid: str) -> KvGrant | None:
        """The reservation writes for this request count against: awaited or quarantined."""
        r = self.records.get(rid)
        if r is None:
            return None
        return r.grant if r.grant is not None else (r.quarantine.grant if r.quarantine else None)

    def write(self, rid: str, attempt: str) -> None:
        """A KV write arrived (landed or fenced): count it for its attempt."""
        g = self._grant_of(rid)
        if g is None:
            self.stray_writes += 1
            return
        if self.records[rid].quarantine is not None and g is self.records[rid].quarantine.grant:
            self.quarantined_writes += 1
        g.received[attempt] += 1

    def granted(self, rid: str, attempt: str, block_ids: list[int]) -> bool:
        """The owner check, failing closed: a write may land only for a request that awaits
        its KV, from an attempt its reservation granted, into blocks of that reservation
        only. A write for an unknown request, for one without a grant (running, reclaimed,
        quarantined), from another attempt (or a previous life of this process), or naming
        any block outside the grant, never does; the epoch fence is checked after this.
        Pure: asked once before a write's bytes are read, and again when it is applied."""
        if not self.ack_enabled:      # TEST ONLY: the unprotected system
            return True
        r = self.records.get(rid)
        g = r.grant if r is not None else None
        return g is not None and attempt in g.owners and set(block_ids) <= g.block_set

    def may_land(self, rid: str, attempt: str, block_ids: list[int]) -> bool:
        """granted(), counting a refused write for a reservation (kv_writes_not_owner)."""
        if self.granted(rid, attempt, block_ids):
            return True
        r = self.records.get(rid)
        if r is not None and r.grant is not None:
            self.foreign_writes += 1
        return False

    def writes_received(self, rid: str, attempt: str) -> int:
        g = self._grant_of(rid)
        return g.received[attempt] if g is not None else 0

    def prefill_done(self, rid: str, attempt: str, ok: bool, writes_issued: int) -> Next:
        """The attempt has stopped writing, with writes_issued writes in all."""
        r = self.records.get(rid)
        if r is not None and r.quarantine is not None:
            r.quarantine.grant.final[attempt] = writes_issued
            return Next.IGNORE
        if r is None or not r.wants_kv:
            return Next.IGNORE
        g = r.grant
        if self.ack_enabled and attempt not in g.owners and ok:
            return Next.IGNORE        # never granted: it cannot have written here
        g.final[attempt] = writes_issued
        if not ok or g.received[attempt] != writes_issued:
            return Next.FALLBACK
        return Next.START

    def reclaim_ack(self, rid: str, attempt: str, owner: bool, writes_issued: int) -> None:
        r = self.records.get(rid)
        if r is not None and r.quarantine is not None and owner:
            r.quarantine.grant.final[attempt] = writes_issued

    # ---- transitions decode makes ---------------------------------------------------
    def start(self, rid: str) -> None:
        """AWAITING_KV -> RUNNING with the remote KV (its blocks now belong to the batch)."""
        r = self.records[rid]
        r.status, r.grant = RequestStatus.RUNNING, None

    def fallback(self, rid: str, reason: str, now: float) -> Plan:
        """AWAITING_KV -> RUNNING, prefilled locally; the old reservation is reclaimed."""
        r = self.records[rid]
        r.status = RequestStatus.RUNNING
        grant, r.grant = r.grant, None
        return self._reclaim(r, grant, reason, now)

    def finish(self, rid: str) -> None:
        """RUNNING -> FINISHED (its blocks went back with the engine's sequence)."""
        r = self.records.get(rid)
        if r is not None:
            r.status = RequestStatus.FINISHED
            self.recently_finished[rid] = r.path
            while len(self.recently_finished) > RECENT:
                self.recently_finished.popitem(last=False)
            self._drop_if_done(r)

    def abort(self, rid: str, reason: str, now: float) -> Plan:
        r = self.records.get(rid)
        if r is None or not r.live:
            return Plan.UNKNOWN
        reason = _code(reason)
        self.aborts[reason] += 1
        if not r.wants_kv:
            r.status = RequestStatus.FINISHED
            self._drop_if_done(r)
            return Plan.ENGINE
        r.status = RequestStatus.ABORTING
        grant, r.grant = r.grant, None
        plan = self._reclaim(r, grant, reason, now)
        self._drop_if_done(r)
        return plan

    def _reclaim(self, r: DecodeRequest, grant: KvGrant, reason: str, now: float) -> Plan:
        outcome = (Outcome.UNPROTECTED if not self.ack_enabled
                   else Outcome.UNCLAIMED if not grant.owners
                   else Outcome.ACKED if grant.settled() else None)
        if outcome is not None:
            self.reclaims[outcome.value] += 1
            return Plan.FREE
        r.quarantine = Quarantine(grant, _code(reason), now)
        return Plan.QUARANTINE

    def _drop_if_done(self, r: DecodeRequest) -> None:
        if not r.live and r.quarantine is None:
            self.records.pop(r.request_id, None)

    # ---- quarantine -----------------------------------------------------------------
    def quarantined(self) -> Iterator[DecodeRequest]:
        return (r for r in list(self.records.values()) if r.quarantine is not None)

    def to_ask(self, now: float) -> list[tuple[str, str, str]]:
        """(request, attempt, instance) owners to send a Reclaim now: never asked, or no
        answer for retry_s. Marks them asked."""
        out = []
        for r in self.quarantined():
            q = r.quarantine
            for attempt, instance in q.grant.owners.items():
                if attempt in q.grant.final:
                    continue
                last = q.asked.get(attempt)
                if last is None or now - last >= self.retry_s:
                    q.asked[attempt] = now
                    out.append((r.request_id, attempt, instance))
        return out

    def ready(self, now: float) -> list[tuple[str, Outcome]]:
        """(request, outcome) whose quarantine may end now: ACKED (settled) or LEASE."""
        out = []
        for r in self.quarantined():
            if r.quarantine.grant.settled():
                out.append((r.request_id, Outcome.ACKED))
            elif now - r.quarantine.since >= self.lease_s:
                out.append((r.request_id, Outcome.LEASE))
        return out

    def settled(self, rid: str) -> bool:
        r = self.records.get(rid)
        return r is not None and r.quarantine is not None and r.quarantine.grant.settled()

    def reclaimed(self, rid: str, outcome: Outcome, now: float) -> list[int]:
        """The quarantine ends: returns its engine blocks, for the service to free."""
        r = self.records[rid]
        q, r.quarantine = r.quarantine, None
        self._drop_if_done(r)
        self.reclaims[Outcome(outcome).value] += 1
        self.latencies.append(now - q.since)
        return q.grant.held

    # ---- numbers --------------------------------------------------------------------
    def stats(self) -> dict:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else 0.0

        quarantined = list(self.quarantined())
        return {"aborts": sum(self.aborts.values()), "aborts_by_reason": dict(self.aborts),
                "reclaims": sum(self.reclaims.values()), "reclaims_by_outcome": dict(self.reclaims),
                "requests_live": sum(1 for _ in self.live()),
                "requests_quarantined": len(quarantined),
                "blocks_quarantined": sum(len(r.quarantine.grant.held) for r in quarantined),
                "awaiting_kv": self.awaiting_kv(),
                "claims_granted": self.claims["granted"], "claims_refused": self.claims["refused"],
                "kv_writes_stray": self.stray_writes,
                "kv_writes_not_owner": self.foreign_writes,
                "kv_writes_quarantined": self.quarantined_writes,
                "reclaim_latency_ms": {"n": len(lat), "p50": pct(0.5), "p90": pct(0.9),
                                       "p99": pct(0.99), "max": pct(1.0)},
                "reclaim_latency_buckets": _buckets(lat)}


def _code(reason) -> str:
    return reason.value if isinstance(reason, enum.Enum) else str(reason)


BUCKETS_MS = (1, 10, 100, 1000, 10_000)


def _buckets(lat: list[float]) -> dict[str, int]:
    """Cumulative counts: le_1ms ... le_10000ms, and all."""
    out = {f"le_{b}ms": sum(1 for x in lat if x * 1e3 <= b) for b in BUCKETS_MS}
    out["all"] = len(lat)
    return out
