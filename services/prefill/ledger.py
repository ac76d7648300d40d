"""Prefill-side write ledger: for each job attempt, the KV writes it issued and whether it
may issue more. Pure bookkeeping (no I/O, no clock of its own); KvSender consults it before
every write and the reclaim handler answers from it.

Life cycle of an attempt (one execution of a PrefillJob; a redelivery is a new attempt):

    CLAIMING ──claim granted──▶ WRITING ──every write acknowledged──▶ DONE
        │                          └──a write failed or was refused──▶ FAILED
        └──────── Reclaim ─────────┴──▶ CANCELLED
    refused claim ──▶ CANCELLED (nothing computed, nothing written)

A write is counted as issued just before it is sent, and as completed (acknowledged) or
failed (no acknowledgement: it may still land) when its request ends; in_flight is the
difference. After CANCELLED (or FAILED) may_issue() is False, so no new write starts; the
ReclaimAck is sent once in_flight is 0, with `issued` as the count decode must receive
before it reuses the blocks. Closed entries are kept for `keep_s`, so a Reclaim that
arrives after the attempt ended is still answered with its final count.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(str, enum.Enum):
    CLAIMING = "claiming"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


OPEN = (Phase.CLAIMING, Phase.WRITING)


@dataclass(slots=True)
class Entry:
    request_id: str
    attempt: str
    decode_instance: str
    phase: Phase = Phase.CLAIMING
    issued: int = 0
    completed: int = 0          # acknowledged by decode (applied or fenced)
    failed: int = 0             # ended without an acknowledgement
    closed_at: float | None = None

    @property
    def in_flight(self) -> int:
        return self.issued - self.completed - self.failed


class WriteLedger:
    def __init__(self, keep_s: float = 120.0):
        self.keep_s = keep_s
        self.entries: dict[str, Entry] = {}          # attempt -> entry
        self.cancelled = 0                            # attempts stopped by a Reclaim

    def open(self, request_id: str, attempt: str, decode_instance: str) -> Entry:
        if attempt in self.entries:
            raise ValueError(f"attempt {attempt!r} is already in the ledger")
        e = Entry(request_id, attempt, decode_instance)
        self.entries[attempt] = e
        return e

    def get(self, attempt: str) -> Entry | None:
        return self.entries.get(attempt)

    def granted(self, attempt: str) -> bool:
        """CLAIMING -> WRITING; False if the attempt was cancelled meanwhile."""
        e = self.entries[attempt]
        if e.phase is Phase.CLAIMING:
            e.phase = Phase.WRITING
        return e.phase is Phase.WRITING

    def may_issue(self, attempt: str) -> bool:
        e = self.entries.get(attempt)
        return e is not None and e.phase is Phase.WRITING

    def issue(self, attempt: str) -> None:
        e = self.entries[attempt]
        if e.phase is not Phase.WRITING:
            raise RuntimeError(f"attempt {attempt} is {e.phase.value}: no write may start")
        e.issued += 1

    def complete(self, attempt: str, acked: bool) -> None:
        e = self.entries[attempt]
        if e.in_flight <= 0:
            raise RuntimeError(f"attempt {attempt}: completion without a write in flight")
        if acked:
            e.completed += 1
        else:
            e.failed += 1

    def stop(self, attempt: str) -> None:
        """A write failed or was refused: issue nothing more (WRITING -> FAILED)."""
        e = self.entries[attempt]
        if e.phase in OPEN:
            e.phase = Phase.FAILED

    def cancel(self, attempt: str) -> Entry | None:
        """A Reclaim: no write is issued from now on. None when the attempt is unknown."""
        e = self.entries.get(attempt)
        if e is None:
            return None
        if e.phase in OPEN:
            e.phase = Phase.CANCELLED
            self.cancelled += 1
        return e

    def close(self, attempt: str, now: float) -> Entry:
        """The attempt has ended (its in-flight writes too): DONE unless stopped before."""
        e = self.entries[attempt]
        if e.phase in OPEN:
            e.phase = Phase.DONE if e.phase is Phase.WRITING else Phase.CANCELLED
        if e.closed_at is None:
            e.closed_at = now
        return e

    def reap(self, now: float) -> int:
        """Forget attempts closed more than keep_s ago; how many."""
        old = [a for a, e in self.entries.items()
               if e.closed_at is not None and now - e.closed_at > self.keep_s]
        for a in old:
            del self.entries[a]
        return len(old)

    def stats(self) -> dict:
        live = [e for e in self.entries.values() if e.closed_at is None]
        return {"attempts_open": len(live),
                "kv_writes_in_flight": sum(e.in_flight for e in live),
                "attempts_cancelled": self.cancelled}
