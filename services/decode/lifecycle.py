"""Decode-side request lifecycle: pure bookkeeping of who may still write a request's KV
blocks, and when those blocks may be reused (invariant 3). No I/O, no clock of its own:
the service feeds it events and carries out what it answers.

Life cycle of a request:

    ALLOCATED ──job queued──▶ AWAITING_KV ──PrefillDone OK, every write in──▶ RUNNING ──▶ FINISHED
        │   claims granted here (each prefill attempt that may write is recorded as an owner)
        │                          │
        │                          └── prefill failed / timed out: RUNNING (prefilled
        │                              locally, in fresh blocks); the reservation is
        │                              reclaimed like an abort's, below
        └────────── abort ─────────┴──▶ ABORTING ──reclaimed──▶ RECLAIMED
    colocated requests start in RUNNING; aborting one frees its blocks at once (nobody
    else writes them).

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

Test-only switch: reclaim_ack=False is the unprotected system: every claim is granted and
aborted blocks are freed at once (the epoch fence is then the only guard).
"""
from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field


class State(str, enum.Enum):
    ALLOCATED = "allocated"
    AWAITING_KV = "awaiting_kv"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTING = "aborting"
    RECLAIMED = "reclaimed"


WANTS_KV = (State.ALLOCATED, State.AWAITING_KV)


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


@dataclass(slots=True)
class Reservation:
    """A request's blocks for remote KV and every attempt allowed to write them."""
    block_ids: list[int]
    epochs: list[int]
    owners: dict[str, str] = field(default_factory=dict)    # attempt -> prefill instance
    final: dict[str, int] = field(default_factory=dict)     # attempt -> writes it issued, in all

    def settled(self, received: Counter) -> bool:
        """Every owner has stopped and every write it counted has been received."""
        return all(a in self.final and received[a] >= self.final[a] for a in self.owners)


@dataclass(slots=True)
class Request:
    request_id: str
    state: State
    remote: Reservation | None = None


@dataclass(slots=True)
class Quarantine:
    """A reservation being reclaimed: its blocks stay out of the pool until settled."""
    request_id: str
    res: Reservation
    reason: str
    since: float
    asked: dict[str, float] = field(default_factory=dict)   # attempt -> last Reclaim sent


class Lifecycle:
    def __init__(self, lease_s: float, retry_s: float = 1.0, reclaim_ack: bool = True,
                 keep_latencies: int = 20_000):
        self.lease_s = lease_s
        self.retry_s = retry_s
        self.ack_enabled = reclaim_ack
        self.requests: dict[str, Request] = {}
        self.quarantine: dict[str, Quarantine] = {}
        self.received: dict[str, Counter] = {}    # request -> attempt -> writes received
        self.aborts: Counter = Counter()          # reason -> aborts
        # outcome -> reclaims: unclaimed (freed at once: nobody could write), acked (every
        # owner's writes accounted for), lease (an owner never answered), unprotected
        self.reclaims: Counter = Counter()
        self.claims: Counter = Counter()          # granted / refused
        self.stray_writes = 0                     # writes for no known request
        # quarantine -> free, seconds (immediate frees are counted in reclaims only)
        self.latencies: deque[float] = deque(maxlen=keep_latencies)

    # ---- admission ------------------------------------------------------------------
    def admit_remote(self, rid: str, block_ids: list[int], epochs: list[int]) -> None:
        self._new(rid, State.ALLOCATED, Reservation(list(block_ids), list(epochs)))

    def admit_local(self, rid: str) -> None:
        self._new(rid, State.RUNNING)

    def _new(self, rid: str, state: State, res: Reservation | None = None) -> None:
        if rid in self.requests or rid in self.quarantine:
            raise ValueError(f"request {rid!r} is already known")
        self.requests[rid] = Request(rid, state, res)
        if res is not None:
            self.received[rid] = Counter()

    def queued(self, rid: str) -> None:
        """The PrefillJob is on the work queue."""
        r = self.requests.get(rid)
        if r is not None and r.state is State.ALLOCATED:
            r.state = State.AWAITING_KV

    def state(self, rid: str) -> State | None:
        r = self.requests.get(rid)
        if r is not None:
            return r.state
        return State.ABORTING if rid in self.quarantine else None

    # ---- prefill side events --------------------------------------------------------
    def claim(self, rid: str, attempt: str, instance: str, block_ids: list[int],
              epochs: list[int]) -> tuple[bool, str]:
        """May this attempt write the request's blocks? Granted only while the request
        still wants its KV and the claim names the reservation decode made."""
        ok, why = self._claim(rid, attempt, instance, block_ids, epochs)
        self.claims["granted" if ok else "refused"] += 1
        return ok, why

    def _claim(self, rid, attempt, instance, block_ids, epochs) -> tuple[bool, str]:
        r = self.requests.get(rid)
        if not self.ack_enabled:      # TEST ONLY: the unprotected system lets anyone write
            if r is not None and r.remote is not None:
                r.remote.owners[attempt] = instance
            return True, ""
        if r is None:
            return False, "aborted" if rid in self.quarantine else "unknown request"
        if r.state not in WANTS_KV:
            return False, f"request is {r.state.value}"
        if r.remote.block_ids != list(block_ids) or r.remote.epochs != list(epochs):
            return False, "claim names another reservation"
        r.remote.owners[attempt] = instance
        return True, ""

    def write(self, rid: str, attempt: str) -> None:
        """A KV write arrived (landed or fenced): count it for its attempt."""
        got = self.received.get(rid)
        if got is None:
            self.stray_writes += 1
            return
        got[attempt] += 1

    def writes_received(self, rid: str, attempt: str) -> int:
        got = self.received.get(rid)
        return got[attempt] if got is not None else 0

    def prefill_done(self, rid: str, attempt: str, ok: bool, writes_issued: int) -> Next:
        """The attempt has stopped writing, with writes_issued writes in all."""
        q = self.quarantine.get(rid)
        if q is not None:
            q.res.final[attempt] = writes_issued
            return Next.IGNORE
        r = self.requests.get(rid)
        if r is None or r.state not in WANTS_KV:
            return Next.IGNORE
        if self.ack_enabled and attempt not in r.remote.owners and ok:
            return Next.IGNORE        # never granted: it cannot have written here
        r.remote.final[attempt] = writes_issued
        if not ok or self.writes_received(rid, attempt) != writes_issued:
            return Next.FALLBACK
        return Next.START

    def reclaim_ack(self, rid: str, attempt: str, owner: bool, writes_issued: int) -> None:
        q = self.quarantine.get(rid)
        if q is not None and owner:
            q.res.final[attempt] = writes_issued

    # ---- transitions decode makes ---------------------------------------------------
    def start(self, rid: str) -> None:
        """AWAITING_KV -> RUNNING with the remote KV (its blocks now belong to the batch)."""
        r = self.requests[rid]
        r.state = State.RUNNING
        r.remote = None
        self.received.pop(rid, None)

    def fallback(self, rid: str, reason: str, now: float) -> Plan:
        """AWAITING_KV -> RUNNING, prefilled locally; the old reservation is reclaimed."""
        r = self.requests[rid]
        r.state = State.RUNNING
        res, r.remote = r.remote, None
        return self._reclaim(rid, res, reason, now)

    def finish(self, rid: str) -> None:
        """RUNNING -> FINISHED (its blocks went back with the engine's sequence)."""
        r = self.requests.pop(rid, None)
        if r is not None:
            r.state = State.FINISHED

    def abort(self, rid: str, reason: str, now: float) -> Plan:
        r = self.requests.pop(rid, None)
        if r is None:
            return Plan.UNKNOWN
        self.aborts[reason] += 1
        if r.state not in WANTS_KV:
            r.state = State.FINISHED
            return Plan.ENGINE
        r.state = State.ABORTING
        return self._reclaim(rid, r.remote, reason, now)

    def _reclaim(self, rid: str, res: Reservation, reason: str, now: float) -> Plan:
        outcome = ("unprotected" if not self.ack_enabled else "unclaimed" if not res.owners
                   else "acked" if res.settled(self.received[rid]) else None)
        if outcome is not None:
            self.received.pop(rid, None)
            self.reclaims[outcome] += 1
            return Plan.FREE
        self.quarantine[rid] = Quarantine(rid, res, reason, now)
        return Plan.QUARANTINE

    # ---- quarantine -----------------------------------------------------------------
    def to_ask(self, now: float) -> list[tuple[str, str, str]]:
        """(request, attempt, instance) owners to send a Reclaim now: never asked, or no
        answer for retry_s. Marks them asked."""
        out = []
        for q in self.quarantine.values():
            for attempt, instance in q.res.owners.items():
                if attempt in q.res.final:
                    continue
                last = q.asked.get(attempt)
                if last is None or now - last >= self.retry_s:
                    q.asked[attempt] = now
                    out.append((q.request_id, attempt, instance))
        return out

    def ready(self, now: float) -> list[tuple[str, str]]:
        """(request, outcome) whose quarantine may end now: "acked" (settled) or "lease"."""
        out = []
        for rid, q in self.quarantine.items():
            if q.res.settled(self.received[rid]):
                out.append((rid, "acked"))
            elif now - q.since >= self.lease_s:
                out.append((rid, "lease"))
        return out

    def settled(self, rid: str) -> bool:
        q = self.quarantine.get(rid)
        return q is not None and q.res.settled(self.received[rid])

    def reclaimed(self, rid: str, outcome: str, now: float) -> None:
        """ABORTING -> RECLAIMED: the service has returned the blocks to the pool."""
        q = self.quarantine.pop(rid)
        self.received.pop(rid, None)
        self.reclaims[outcome] += 1
        self.latencies.append(now - q.since)

    # ---- numbers --------------------------------------------------------------------
    def stats(self) -> dict:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else 0.0

        return {"aborts": sum(self.aborts.values()), "aborts_by_reason": dict(self.aborts),
                "reclaims": sum(self.reclaims.values()), "reclaims_by_outcome": dict(self.reclaims),
                "requests_live": len(self.requests), "requests_quarantined": len(self.quarantine),
                "claims_granted": self.claims["granted"], "claims_refused": self.claims["refused"],
                "kv_writes_stray": self.stray_writes,
                "reclaim_latency_ms": {"n": len(lat), "p50": pct(0.5), "p90": pct(0.9),
                                       "p99": pct(0.99), "max": pct(1.0)},
                "reclaim_latency_buckets": _buckets(lat)}


BUCKETS_MS = (1, 10, 100, 1000, 10_000)


def _buckets(lat: list[float]) -> dict[str, int]:
    """Cumulative counts: le_1ms ... le_10000ms, and all."""
    out = {f"le_{b}ms": sum(1 for x in lat if x * 1e3 <= b) for b in BUCKETS_MS}
    out["all"] = len(lat)
    return out
