"""Who may write a decode instance's KV blocks, and when it must stop (invariant 3).

    prefill -> decode   PrefillClaim  -> ClaimReply    before computing a job: may this
                                                        attempt write the job's blocks?
    decode  -> prefill  Reclaim       -> ReclaimAck    the request was aborted: stop writing,
                                                        wait for writes in flight, count them

A claim is granted only while the request still waits for its KV, so decode always knows
every attempt (one prefill execution of a job) that may write its blocks, and a job pulled
after the abort (late, or redelivered after a crash) is refused before it writes anything.
"""
from __future__ import annotations

import msgspec

from .common import VERSION


class PrefillClaim(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """prefill -> decode: this attempt wants to write the job's destination blocks."""
    v: int = VERSION
    request_id: str
    attempt: str                   # unique per execution of a job (a redelivery is a new one)
    prefill_instance: str          # where a Reclaim for this attempt goes
    block_ids: list[int]           # the job's destination, as the job carried it
    epochs: list[int]


class ClaimReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    granted: bool
    reason: str = ""               # why not: "unknown request", "not awaiting KV", ...


class Reclaim(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """decode -> prefill: stop writing this attempt's KV; answer once nothing is in flight."""
    v: int = VERSION
    request_id: str
    attempt: str
    decode_instance: str
    reason: str = ""


class ReclaimAck(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """prefill -> decode. owner=True: the attempt is known here, will issue no more writes,
    and every write it issued has completed (acknowledged or failed); writes_issued counts
    them all. owner=False: this process does not know the attempt (it restarted, or never
    ran it), so it cannot vouch for it: decode waits for the lease."""
    v: int = VERSION
    request_id: str
    attempt: str
    prefill_instance: str
    owner: bool
    writes_issued: int = 0
    writes_completed: int = 0      # acknowledged by decode (applied or fenced)
    writes_failed: int = 0         # no acknowledgement (timeout, connection): may still land
