"""DecodeSubmit -> PrefillJob: every field that affects generation crosses the boundary.

Pure, so a test can check, field by field, that nothing the gateway sent is dropped on
the way to prefill (tests/test_job_fields.py)."""
from __future__ import annotations

import time

from shared.contracts.messages import DecodeSubmit, KvDestination, PrefillJob

# fields of DecodeSubmit that PrefillJob must carry unchanged
CARRIED = ("request_id", "prompt_ids", "params", "constraint", "tokenizer_fingerprint",
           "resume_from", "cache_salt")


def make_prefill_job(sub: DecodeSubmit, dest: KvDestination, model: str,
                     block_size: int) -> PrefillJob:
    return PrefillJob(
        request_id=sub.request_id, prompt_ids=sub.prompt_ids, params=sub.params,
        constraint=sub.constraint,
        tokenizer_fingerprint=sub.tokenizer_fingerprint, resume_from=sub.resume_from,
        cache_salt=sub.cache_salt, model=model, block_size=block_size,
        dest=dest, issued_at=time.time())
