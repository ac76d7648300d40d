"""A finished request's phases (vLLM's queue, prefill and decode time) on the final chunk:
PD's prompt begins when a prefill worker's claim is granted, colocated's at its first
engine step."""
from __future__ import annotations

from services.decode.request import DecodeRequest, RequestStatus
from services.decode.stream import phases
from shared.contracts.messages import Path
from shared.engine.output import RequestOutput


def test_pd_phases_start_at_the_granted_claim():
    r = DecodeRequest("r", RequestStatus.RUNNING, path=Path.PD, submitted=10.0, began=10.5,
                      first_token=11.0)
    o = RequestOutput("r", [1], finished=True, scheduled_at=10.9)   # decode's own first step
    assert phases(o, r, now=13.0) == {"queue_s": 0.5, "prefill_s": 0.5, "decode_s": 2.0}


def test_colocated_phases_start_at_the_first_engine_step():
    r = DecodeRequest("r", RequestStatus.RUNNING, submitted=10.0, first_token=10.75)
    o = RequestOutput("r", [1], finished=True, scheduled_at=10.25)
    assert phases(o, r, now=11.0) == {"queue_s": 0.25, "prefill_s": 0.5, "decode_s": 0.25}


def test_a_one_chunk_answer_has_no_decode_time_and_nothing_is_negative():
    r = DecodeRequest("r", RequestStatus.RUNNING, submitted=10.0)
    o = RequestOutput("r", [1], finished=True)                      # never stepped here
    p = phases(o, r, now=12.0)
    assert p == {"queue_s": 2.0, "prefill_s": 0.0, "decode_s": 0.0}
