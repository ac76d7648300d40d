"""Prefill's two messages to decode about an attempt besides its writes: the claim on
the job's blocks (PrefillClaim, granted only while decode still wants the KV) and the
PrefillDone that reports a computed prompt."""
from __future__ import annotations

import logging

from shared import tracing
from shared.contracts.messages import PrefillDone, PrefillJob, PrefillStatus
from shared.contracts.reclaim import PrefillClaim
from shared.engine.output import RequestOutput

from .ledger import WriteLedger

log = logging.getLogger("pdmesh.prefill")


async def claim(peers, ledger: WriteLedger, iid: str, job: PrefillJob, attempt: str,
                timeout_s: float) -> bool:
    """Ask decode for the job's blocks; False when refused, unanswered, or reclaimed
    while asking."""
    c = PrefillClaim(request_id=job.request_id, attempt=attempt, prefill_instance=iid,
                     block_ids=job.dest.block_ids, epochs=job.dest.epochs)
    try:
        with tracing.span("claim", kind="CLIENT", decode=job.dest.instance_id):
            reply = await peers.claim(job.dest.instance_id, c, timeout_s)
    except Exception as e:  # noqa: BLE001 - decode gone or silent: it cannot use this KV
        log.info("%s: claim unanswered (%r); dropping the job", job.request_id, e)
        return False
    if not reply.granted:
        log.debug("%s: claim refused: %s", job.request_id, reply.reason)
        return False
    return ledger.granted(attempt)


def ok_done(job: PrefillJob, iid: str, attempt: str, out: RequestOutput, compute_s: float,
            writes: int, nbytes: int, transfer_s: float = 0.0) -> PrefillDone:
    """The PrefillDone of a computed prompt: its first token, the writes issued."""
    lp = out.logprobs[0] if out.logprobs else (None, None, None)
    return PrefillDone(request_id=job.request_id, status=PrefillStatus.OK, prefill_instance=iid,
                       first_token=out.new_token_ids[0], first_logprob=lp[1],
                       first_top_logprobs=lp[2], writes_issued=writes, bytes_sent=nbytes,
                       compute_s=compute_s, transfer_s=transfer_s, attempt=attempt,
                       cached_tokens=out.num_cached_tokens)
