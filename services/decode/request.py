"""One decode request, one record: where it stands, where its tokens go, which blocks a
remote prefill may write, and (while it is being reclaimed) its quarantine.

    ALLOCATED ──job queued──▶ AWAITING_KV ──PrefillDone OK, every write in──▶ RUNNING ──▶ FINISHED
        │                          │                      ▲
        │                          └── prefill failed / ──┘ (prefilled here, in fresh blocks;
        │                              timed out               the old reservation is
        │                                                      quarantined, below)
        └────────── abort ─────────┴──▶ ABORTING ──every writer accounted for──▶ (gone)

A colocated request starts RUNNING. A reservation that an attempt may still write is
never freed at once: it becomes the record's `quarantine`, which keeps its engine blocks
out of the pool until every owner's writes are accounted for (or its lease ends). A
RUNNING request can carry a quarantine too (after a fallback), and a FINISHED or ABORTING
record stays in the table until its quarantine ends, so its id is not reused meanwhile.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from shared.contracts.messages import Path


class RequestStatus(str, enum.Enum):
    ALLOCATED = "allocated"        # blocks reserved for remote KV; the job is not queued yet
    AWAITING_KV = "awaiting_kv"    # job queued: claims are granted, writes land
    RUNNING = "running"            # in the engine's batch (remote KV in, or prefilled here)
    FINISHED = "finished"          # done; kept only while an old reservation is reclaimed
    ABORTING = "aborting"          # aborted; kept only while its reservation is reclaimed


WANTS_KV = (RequestStatus.ALLOCATED, RequestStatus.AWAITING_KV)
LIVE = (*WANTS_KV, RequestStatus.RUNNING)


class Outcome(str, enum.Enum):
    """How a reservation's blocks went back to the pool."""
    UNCLAIMED = "unclaimed"        # nobody was allowed to write: freed at once
    ACKED = "acked"                # every owner's writes accounted for
    LEASE = "lease"                # an owner never answered: the lease ended it
    UNPROTECTED = "unprotected"    # TEST ONLY: reclaim-ack off, freed at once


@dataclass(slots=True, eq=False)
class KvGrant:
    """A reservation for remote KV: the blocks prefill writes (with their epochs), every
    engine block it holds, and every attempt allowed to write."""
    block_ids: list[int]                  # the writer's destination blocks
    epochs: list[int]
    held: list[int]                       # every engine block of the reservation
    owners: dict[str, str] = field(default_factory=dict)    # attempt -> prefill instance
    final: dict[str, int] = field(default_factory=dict)     # attempt -> writes it issued, in all
    received: Counter = field(default_factory=Counter)      # attempt -> writes received

    @property
    def block_set(self) -> frozenset[int]:
        return frozenset(self.block_ids)

    def settled(self) -> bool:
        """Every owner has stopped and every write it counted has been received."""
        return all(a in self.final and self.received[a] >= self.final[a] for a in self.owners)


@dataclass(slots=True, eq=False)
class Quarantine:
    """A reservation being reclaimed: its blocks stay out of the pool until settled."""
    grant: KvGrant
    reason: str
    since: float
    asked: dict[str, float] = field(default_factory=dict)   # attempt -> last Reclaim sent


@dataclass(slots=True, eq=False)
class DecodeRequest:
    request_id: str
    status: RequestStatus
    path: Path = Path.COLOCATED
    reply_subject: str = ""
    gateway: str = ""                     # whose request it is (orphan detection)
    submitted: float = 0.0
    grant: KvGrant | None = None          # while ALLOCATED / AWAITING_KV
    quarantine: Quarantine | None = None  # an old reservation being reclaimed
    chunks: int = 0                       # TokenChunks sent (their seq)
    cached_tokens: int = 0                # prefill's prefix-cache hit (PD)
    began: float = 0.0                    # monotonic: its prompt began (a granted claim)
    first_token: float = 0.0              # monotonic: its first chunk

    @property
    def live(self) -> bool:
        return self.status in LIVE

    @property
    def wants_kv(self) -> bool:
        return self.status in WANTS_KV
