"""Every NATS subject pdmesh uses. No subject string appears anywhere else.

Rules: lowercase, dot-separated, `_` inside tokens, at most 5 tokens.
  work              pdmesh.<service>.<endpoint>
  instance-directed pdmesh.<service>.<endpoint>.<instance_id>
  events            pdmesh.evt.<domain>.<event>
"""
from __future__ import annotations

import re

PREFIX = "pdmesh"
_TOKEN = re.compile(r"^[a-z0-9_]+$")

# JetStream work queue for prefill jobs (redelivered if a prefill worker dies)
PREFILL_STREAM = "PDMESH_PREFILL"
PREFILL_CONSUMER = "prefill_workers"


def _subject(*tokens: str) -> str:
    for t in tokens:
        if not _TOKEN.match(t):
            raise ValueError(f"bad subject token {t!r}: lowercase letters, digits and _ only")
    s = ".".join((PREFIX, *tokens))
    assert s.count(".") < 5, s
    return s


def instance_token(raw: str) -> str:
    """Normalise an instance id into a valid subject token."""
    return re.sub(r"[^a-z0-9_]", "_", raw.lower())


# ---- decode --------------------------------------------------------------------------
def decode_submit(instance: str) -> str:        # gateway -> decode: DecodeSubmit (request)
    return _subject("decode", "submit", instance)


def decode_abort(instance: str) -> str:         # gateway -> decode: Abort
    return _subject("decode", "abort", instance)


def decode_kv(instance: str) -> str:            # prefill -> decode: KV block writes (request)
    return _subject("decode", "kv", instance)


def decode_prefill_done(instance: str) -> str:  # prefill -> decode: PrefillDone (request)
    return _subject("decode", "prefill_done", instance)


def decode_claim(instance: str) -> str:         # prefill -> decode: PrefillClaim -> ClaimReply
    return _subject("decode", "claim", instance)


# ---- prefill -------------------------------------------------------------------------
def prefill_jobs() -> str:                      # decode -> JetStream -> prefill: PrefillJob
    return _subject("prefill", "jobs")


def prefill_reclaim(instance: str) -> str:      # decode -> prefill: Reclaim -> ReclaimAck
    return _subject("prefill", "reclaim", instance)


# ---- gateway -------------------------------------------------------------------------
def gateway_tokens(instance: str) -> str:       # decode -> gateway: TokenChunk stream
    return _subject("gateway", "tokens", instance)


# ---- kvstore -------------------------------------------------------------------------
def kvstore_health() -> str:
    return _subject("kvstore", "health")


def kvstore_lookup() -> str:                    # prefill -> kvstore: KvLookup -> KvLookupReply
    return _subject("kvstore", "lookup")


def kvstore_fetch() -> str:                     # prefill -> kvstore: KvFetch -> KvFetchReply
    return _subject("kvstore", "fetch")


def kvstore_layer(instance: str) -> str:        # prefill -> kvstore: KvLayerPull -> raw layer
    return _subject("kvstore", "layer", instance)


def kvstore_put() -> str:                       # prefill -> kvstore: raw blocks (KvPut headers)
    return _subject("kvstore", "put")


# ---- health endpoints (every service answers Health on its own) -----------------------
def health(service: str, instance: str) -> str:
    return _subject(service, "health", instance)


# ---- events --------------------------------------------------------------------------
def heartbeat(service: str) -> str:             # every service: Heartbeat, once a second
    return _subject("evt", service, "heartbeat")


def heartbeats_all() -> str:
    return f"{PREFIX}.evt.*.heartbeat"


def request_event(event: str) -> str:           # e.g. aborted, redispatched
    return _subject("evt", "request", event)


def request_anomaly() -> str:                   # decode: AnomalyEvent (speculative monitor)
    return request_event("anomaly")


# ---- bench ---------------------------------------------------------------------------
def bench_raw(run: str) -> str:                 # pdmesh bench: raw request/reply baseline
    return _subject("bench", "raw", run)


ALL = f"{PREFIX}.>"
