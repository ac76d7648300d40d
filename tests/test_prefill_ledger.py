"""The prefill write ledger (services/prefill/ledger.py): after a Reclaim no write starts,
and the count it answers with covers every write issued."""
from __future__ import annotations

import pytest

from services.prefill.ledger import Phase, WriteLedger


def writing(ledger: WriteLedger, attempt: str = "a1"):
    e = ledger.open("r", attempt, "d0")
    assert ledger.granted(attempt)
    return e


def test_writes_issue_and_complete_then_done():
    led = WriteLedger()
    e = writing(led)
    for _ in range(3):
        assert led.may_issue("a1")
        led.issue("a1")
    led.complete("a1", acked=True)
    led.complete("a1", acked=False)
    assert e.in_flight == 1
    led.complete("a1", acked=True)
    assert (e.issued, e.completed, e.failed, e.in_flight) == (3, 2, 1, 0)
    assert led.close("a1", now=0.0).phase is Phase.DONE


def test_cancel_stops_new_writes_and_keeps_the_count():
    led = WriteLedger()
    e = writing(led)
    led.issue("a1")
    assert led.cancel("a1") is e and e.phase is Phase.CANCELLED
    assert not led.may_issue("a1")
    with pytest.raises(RuntimeError):
        led.issue("a1")
    assert e.in_flight == 1            # the answer waits for this one
    led.complete("a1", acked=True)
    assert e.in_flight == 0 and e.issued == 1
    assert led.close("a1", 1.0).phase is Phase.CANCELLED
    assert led.stats()["attempts_cancelled"] == 1


def test_cancel_while_claiming_means_the_grant_is_not_used():
    led = WriteLedger()
    led.open("r", "a1", "d0")
    led.cancel("a1")
    assert led.granted("a1") is False
    assert not led.may_issue("a1")


def test_failed_write_stops_the_attempt():
    led = WriteLedger()
    writing(led)
    led.issue("a1")
    led.stop("a1")
    assert not led.may_issue("a1")
    led.complete("a1", acked=False)
    assert led.close("a1", 0.0).phase is Phase.FAILED


def test_unknown_attempt_and_reaping():
    led = WriteLedger(keep_s=10)
    assert led.cancel("nope") is None
    writing(led)
    led.close("a1", now=0.0)
    assert led.cancel("a1") is not None      # a late Reclaim still gets the final count
    assert led.reap(now=5.0) == 0
    assert led.reap(now=11.0) == 1 and led.get("a1") is None


def test_completion_without_a_write_in_flight_is_a_bug():
    led = WriteLedger()
    writing(led)
    with pytest.raises(RuntimeError):
        led.complete("a1", acked=True)
