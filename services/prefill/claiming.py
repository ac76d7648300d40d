"""Prefill's two messages to decode about an attempt besides its writes: the claim on
the job's blocks (PrefillClaim, granted only while decode still wants the KV) and the
PrefillDone that reports a computed prompt (or why there is none); and the checks that
refuse a job before any of them."""
from __future__ import annotations

import logging

from shared import tracing
from shared.contracts.common import ErrorCode, ErrorReply
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


def failed_done(job: PrefillJob, iid: str, code: ErrorCode, message: str,
                attempt: str = "") -> PrefillDone:
    return PrefillDone(request_id=job.request_id, status=PrefillStatus.FAILED,
                       prefill_instance=iid, attempt=attempt,
                       error=ErrorReply(code=code, message=message, request_id=job.request_id))


def refuse_reason(engine, fingerprint: str, job: PrefillJob) -> tuple[ErrorCode, str] | None:
    """Why this prefill worker cannot compute the job at all (None: it can)."""
    if job.tokenizer_fingerprint != fingerprint:
        return ErrorCode.TOKENIZER_MISMATCH, "job tokenizer fingerprint differs from prefill's"
    if job.block_size != engine.cfg.block_size:
        return ErrorCode.INVALID_REQUEST, (
            f"block size {job.block_size} != prefill's {engine.cfg.block_size}")
    try:
        engine.check_request(job.prompt_ids, job.params)
    except ValueError as e:
        return ErrorCode.INVALID_REQUEST, str(e)
    return None
