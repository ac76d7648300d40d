"""DecodeSubmit -> PrefillJob: every field that affects generation crosses the boundary;
and the PrefillDone a KV write carried back (carried_done).

Pure, so a test can check, field by field, that nothing the gateway sent is dropped on
the way to prefill (tests/test_job_fields.py)."""
from __future__ import annotations

import time

import msgspec

from shared.contracts.common import ErrorCode, ErrorReply
from shared.contracts.kv import KvWrite
from shared.contracts.messages import (
    DecodeSubmit,
    KvDestination,
    PrefillDone,
    PrefillJob,
    PrefillStatus,
)

# fields of DecodeSubmit that PrefillJob must carry unchanged
CARRIED = ("request_id", "prompt_ids", "params", "constraint", "tokenizer_fingerprint",
           "resume_from", "cache_salt")


def make_prefill_job(sub: DecodeSubmit, dest: KvDestination, model: str,
                     block_size: int, kvstore_blocks: int | None = None) -> PrefillJob:
    return PrefillJob(
        request_id=sub.request_id, prompt_ids=sub.prompt_ids, params=sub.params,
        constraint=sub.constraint,
        tokenizer_fingerprint=sub.tokenizer_fingerprint, resume_from=sub.resume_from,
        cache_salt=sub.cache_salt, model=model, block_size=block_size,
        dest=dest, issued_at=time.time(), kvstore_blocks=kvstore_blocks)


def carried_done(w: KvWrite, landed: bool, attempt: str) -> PrefillDone:
    """The PrefillDone a request's only KV write carried, as decode takes it: FAILED
    unless that write landed (a fenced write never starts a request: its blocks hold no
    prompt) and the PrefillDone is the write's own (its request, one write), under the
    write's attempt."""
    done = w.done
    if not landed or done.request_id != w.request_id or done.writes_issued != 1:
        done = msgspec.structs.replace(
            done, request_id=w.request_id, status=PrefillStatus.FAILED, writes_issued=1,
            error=ErrorReply(code=ErrorCode.PREFILL_FAILED, request_id=w.request_id,
                             message="the write carrying PrefillDone did not land"))
    return msgspec.structs.replace(done, attempt=attempt)
