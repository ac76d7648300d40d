"""Decode's request table (services/decode/lifecycle.py), event by event: blocks a
claimed prefill attempt may still write are never freed before every write it counted has
arrived, or before the lease ends."""
from __future__ import annotations

import pytest

from services.decode.lifecycle import Next, Plan, RequestTable
from services.decode.request import RequestStatus as State

B, E = [4, 5], [11, 12]


def remote(life: RequestTable, rid: str = "r") -> None:
    life.admit_remote(rid, B, E)
    life.queued(rid)


def test_happy_path_allocated_awaiting_running_finished():
    life = RequestTable(lease_s=5)
    life.admit_remote("r", B, E)
    assert life.state("r") is State.ALLOCATED
    life.queued("r")
    assert life.state("r") is State.AWAITING_KV
    assert life.claim("r", "a1", "p0", B, E) == (True, "")
    life.write("r", "a1")
    life.write("r", "a1")
    assert life.prefill_done("r", "a1", ok=True, writes_issued=2) is Next.START
    life.start("r")
    assert life.state("r") is State.RUNNING
    life.finish("r")
    assert life.state("r") is None
    assert life.stats()["aborts"] == 0


def test_abort_before_any_claim_frees_at_once_and_refuses_later_claims():
    life = RequestTable(lease_s=5)
    remote(life)
    assert life.abort("r", "client", now=0.0) is Plan.FREE
    assert life.claim("r", "a1", "p0", B, E) == (False, "unknown request")
    st = life.stats()
    assert st["reclaims_by_outcome"] == {"unclaimed": 1} and st["claims_refused"] == 1


def test_abort_with_owner_quarantines_until_ack_and_every_counted_write():
    life = RequestTable(lease_s=5)
    remote(life)
    life.claim("r", "a1", "p0", B, E)
    life.write("r", "a1")
    assert life.abort("r", "client", now=1.0) is Plan.QUARANTINE
    assert life.state("r") is State.ABORTING
    assert life.to_ask(now=1.0) == [("r", "a1", "p0")]
    assert life.to_ask(now=1.1) == []                   # asked already, not yet due again
    life.reclaim_ack("r", "a1", owner=True, writes_issued=3)
    assert not life.settled("r") and life.ready(now=1.2) == []   # 2 writes still on the wire
    life.write("r", "a1")
    assert not life.settled("r")
    life.write("r", "a1")
    assert life.settled("r") and life.ready(now=1.3) == [("r", "acked")]
    assert life.reclaimed("r", "acked", now=1.5) == B     # the blocks to free
    assert life.state("r") is None
    st = life.stats()
    assert st["reclaims_by_outcome"] == {"acked": 1} and st["aborts_by_reason"] == {"client": 1}
    assert st["reclaim_latency_ms"]["max"] == pytest.approx(500.0)


def test_not_owner_answer_does_not_free_the_lease_does():
    life = RequestTable(lease_s=5, retry_s=1)
    remote(life)
    life.claim("r", "a1", "p0", B, E)
    life.abort("r", "timeout", now=0.0)
    life.to_ask(0.0)
    life.reclaim_ack("r", "a1", owner=False, writes_issued=0)   # a restarted p0 knows nothing
    assert life.ready(now=4.9) == []
    assert life.to_ask(now=1.0) == [("r", "a1", "p0")]        # asked again
    assert life.ready(now=5.0) == [("r", "lease")]


def test_every_owner_must_answer_redelivered_job_has_two():
    life = RequestTable(lease_s=5)
    remote(life)
    life.claim("r", "a1", "p0", B, E)
    life.claim("r", "a2", "p1", B, E)          # the job was redelivered after p0 went silent
    life.abort("r", "client", 0.0)
    assert {a for _, a, _ in life.to_ask(0.0)} == {"a1", "a2"}
    life.reclaim_ack("r", "a2", owner=True, writes_issued=0)
    assert not life.settled("r")
    life.prefill_done("r", "a1", ok=False, writes_issued=0)   # a PrefillDone also gives a count
    assert life.settled("r")


def test_claim_must_name_the_reservation_and_the_request_must_want_kv():
    life = RequestTable(lease_s=5)
    remote(life)
    assert life.claim("r", "a1", "p0", B, [11, 99]) == (False, "claim names another reservation")
    life.claim("r", "a1", "p0", B, E)
    life.write("r", "a1")
    life.prefill_done("r", "a1", ok=True, writes_issued=1)
    life.start("r")
    assert life.claim("r", "a2", "p1", B, E) == (False, "request is running")


def test_prefill_done_with_missing_writes_or_failure_falls_back_and_reclaims():
    life = RequestTable(lease_s=5)
    remote(life)
    life.claim("r", "a1", "p0", B, E)
    life.write("r", "a1")
    assert life.prefill_done("r", "a1", ok=True, writes_issued=2) is Next.FALLBACK
    assert life.fallback("r", "prefill_failed", now=0.0) is Plan.QUARANTINE
    assert life.state("r") is State.RUNNING                    # prefilled locally
    assert life.claim("r", "a2", "p1", B, E)[0] is False       # a redelivery cannot write
    life.write("r", "a1")                                       # the missing write lands late
    assert life.ready(0.1) == [("r", "acked")]
    life.reclaimed("r", "acked", 0.1)
    assert life.state("r") is State.RUNNING                    # the request itself lives on


def test_prefill_done_from_an_attempt_never_granted_is_ignored():
    life = RequestTable(lease_s=5)
    remote(life)
    assert life.prefill_done("r", "ghost", ok=True, writes_issued=0) is Next.IGNORE
    assert life.state("r") is State.AWAITING_KV


def test_abort_of_running_or_unknown_request():
    life = RequestTable(lease_s=5)
    life.admit_local("c")
    assert life.abort("c", "client", 0.0) is Plan.ENGINE
    assert life.abort("c", "client", 0.0) is Plan.UNKNOWN
    assert life.abort("nobody", "client", 0.0) is Plan.UNKNOWN
    assert life.stats()["aborts"] == 1


def test_writes_for_unknown_requests_are_counted_as_stray():
    life = RequestTable(lease_s=5)
    life.write("gone", "a1")
    assert life.stats()["kv_writes_stray"] == 1


def test_without_reclaim_ack_every_claim_is_granted_and_blocks_free_at_once():
    life = RequestTable(lease_s=5, reclaim_ack=False)
    remote(life)
    life.claim("r", "a1", "p0", B, E)
    assert life.abort("r", "client", 0.0) is Plan.FREE
    assert life.claim("r", "a2", "p0", B, E) == (True, "")
    assert life.stats()["reclaims_by_outcome"] == {"unprotected": 1}


def test_duplicate_admission_is_refused():
    life = RequestTable(lease_s=5)
    remote(life)
    with pytest.raises(ValueError):
        life.admit_local("r")
