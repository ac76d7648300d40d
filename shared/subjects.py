"""Every NATS subject pdmesh uses. No subject string appears anywhere else.

Rules: lowercase, dot-separated, `_` inside tokens, at most 5 tokens.
  work              pdmesh.<service>.<endpoint>
  instance-directed pdmesh.<service>.<endpoint>.<instance_id>
  events            pdmesh.evt.<domain>.<event>
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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


def decode_progress(instance: str) -> str:    # gateway -> decode: ProgressQuery -> ProgressReply
    return _subject("decode", "progress", instance)


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


# ---- who publishes and who subscribes what: the NATS permission table ------------------------
# Every service connects as its own NATS user (IDENTITIES); nats-server grants each exactly
# what GRANTS and CONTROL say, publish and subscribe separately (pdmesh/deploy/creds.py renders it;
# tests/test_subject_grants.py checks that every subject the code builds is here). Replies
# go only to a caller's own inbox, _INBOX.<caller>.>, for the callers REPLIES_TO names (no
# allow_responses: with it a requester chose where a service published its reply, and
# the read-only debug user made services publish onto token, abort and KV subjects).
ANY = "*"                   # any instance id in a pattern
TOOLS = ("bench_raw",)      # subjects only pdmesh's own tools use (no service is granted them)
IDENTITIES = ("gateway", "decode", "prefill", "kvstore")
DEBUG = "debug"             # read-only: sees every message, can ask PING/INFO/STATS/health
ADMIN = "admin"             # provisions the job stream, nothing else (shared/jobstream.py)
_PROBE = "any_instance_probe"


@dataclass(frozen=True)
class Grant:
    fn: str                         # the subject function the code calls
    args: tuple[str, ...] = ()      # its arguments in the pattern (ANY: every instance)
    pub: tuple[str, ...] = ()       # who publishes on it (requests included)
    sub: tuple[str, ...] = ()       # who subscribes to it (serves it)

    @property
    def pattern(self) -> str:
        subject = globals()[self.fn](*(_PROBE if a == ANY else a for a in self.args))
        return subject.replace(_PROBE, ANY)


def pattern(fn: str, *args: str) -> str:
    """A subject function's subject with ANY arguments as wildcards:
    pattern("decode_kv", ANY) == "pdmesh.decode.kv.*"."""
    return Grant(fn, args).pattern


GRANTS: tuple[Grant, ...] = (
    Grant("decode_submit", (ANY,), pub=("gateway",), sub=("decode",)),
    Grant("decode_abort", (ANY,), pub=("gateway",), sub=("decode",)),
    Grant("decode_progress", (ANY,), pub=("gateway",), sub=("decode",)),
    Grant("decode_kv", (ANY,), pub=("prefill",), sub=("decode",)),
    Grant("decode_prefill_done", (ANY,), pub=("prefill",), sub=("decode",)),
    Grant("decode_claim", (ANY,), pub=("prefill",), sub=("decode",)),
    # decode -> JetStream (the work-queue stream stores it); prefill pulls through $JS.API
    Grant("prefill_jobs", pub=("decode",)),
    Grant("prefill_reclaim", (ANY,), pub=("decode",), sub=("prefill",)),
    Grant("gateway_tokens", (ANY,), pub=("decode",), sub=("gateway",)),
    Grant("kvstore_health", pub=(DEBUG,), sub=("kvstore",)),
    Grant("kvstore_lookup", pub=("decode", "prefill"), sub=("kvstore",)),
    Grant("kvstore_fetch", pub=("decode", "prefill"), sub=("kvstore",)),
    Grant("kvstore_layer", (ANY,), pub=("decode", "prefill"), sub=("kvstore",)),
    # only who computed the KV writes it: prefill, and decode for prompts it computed
    # itself (colocated; shared/kv/writeback.py)
    Grant("kvstore_put", pub=("prefill", "decode"), sub=("kvstore",)),
    # each service answers its own health; its container's health check asks it
    *(Grant("health", (s, ANY), pub=(s, DEBUG), sub=(s,)) for s in IDENTITIES),
    # a heartbeat comes only from its own service
    Grant("heartbeat", ("gateway",), pub=("gateway",), sub=("decode",)),
    Grant("heartbeat", ("decode",), pub=("decode",), sub=("prefill",)),   # shm: same host?
    Grant("heartbeat", ("prefill",), pub=("prefill",), sub=("decode",)),
    Grant("heartbeat", ("kvstore",), pub=("kvstore",), sub=("decode", "prefill")),  # silence
    Grant("heartbeats_all", sub=("gateway",)),
    Grant("request_anomaly", pub=("decode",)),
)


def _srv(verb: str, service: str = "") -> str:       # nats.micro control subjects
    return "$SRV." + verb + (f".{service}" if service else "")


def _js(*tokens: str) -> str:                        # JetStream API subjects
    return ".".join(("$JS.API", *tokens))


def _stream_admin() -> list[str]:    # jobstream.ensure_stream: make, repair, re-make the stream
    return [_js("STREAM", verb, PREFILL_STREAM)
            for verb in ("INFO", "CREATE", "UPDATE", "DELETE")]


def _consumer() -> list[str]:        # the prefill workers' durable pull consumer
    c = (PREFILL_STREAM, PREFILL_CONSUMER)
    return [_js("CONSUMER", "CREATE", *c), _js("CONSUMER", "CREATE", *c, ">"),
            _js("CONSUMER", "DURABLE", "CREATE", *c), _js("CONSUMER", "INFO", *c),
            _js("CONSUMER", "MSG", "NEXT", *c), f"$JS.ACK.{PREFILL_STREAM}.{PREFILL_CONSUMER}.>"]


# whose requests each service answers (its replies may go to those inboxes only): gateway
# submits and aborts at decode, prefill claims, writes KV and says done there, decode
# reclaims at prefill, decode and prefill use kvstore, the gateway reads prefill's and
# kvstore's STATS, debug asks everyone ($SRV, health), and a container's health check asks
# its own service as that service's user
REPLIES_TO: dict[str, tuple[str, ...]] = {
    "gateway": (),
    "decode": ("gateway", "prefill"),
    "prefill": ("decode", "gateway"),
    "kvstore": ("decode", "prefill", "gateway"),
}

# the nats.micro requests a service makes of another ($SRV.<verb>.<service>): the gateway's
# /metrics federates every service's STATS (services/gateway/scrape.py)
SRV_REQUESTS: dict[str, tuple[tuple[str, str], ...]] = {
    "gateway": (("STATS", "kvstore"), ("STATS", "prefill"), ("STATS", "decode")),
}


def control(identity: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) outside pdmesh.>: nats.micro ($SRV), JetStream ($JS), inbox."""
    if identity == DEBUG:   # read-only tools: `nats sub`, `nats micro`, `nats stream info`
        return ([_srv(">"), _js("INFO"), _js("STREAM", "INFO", ANY), _js("STREAM", "NAMES"),
                 _js("STREAM", "LIST"), _js("CONSUMER", "INFO", ANY, ANY),
                 _js("CONSUMER", "NAMES", ANY), _js("CONSUMER", "LIST", ANY),
                 # pdmesh bench's raw request/reply floor: a subject no service reads,
                 # answered into debug's own inbox
                 pattern("bench_raw", ANY), f"_INBOX.{DEBUG}.>"], [">"])
    if identity == ADMIN:   # no service may change the stream (a `republish` rule, a seal)
        return [_js("INFO"), *_stream_admin()], [f"_INBOX.{identity}.>"]
    stream_info = [_js("STREAM", "INFO", PREFILL_STREAM)]      # jobstream.wait_stream
    pub = [_srv("PING", identity)]            # its container's health check finds it
    pub += {"decode": stream_info, "prefill": stream_info + _consumer()}.get(identity, [])
    pub += [_srv(verb, service) for verb, service in SRV_REQUESTS.get(identity, ())]
    pub += [f"_INBOX.{caller}.>" for caller in (*REPLIES_TO.get(identity, ()), DEBUG, identity)]
    sub = [_srv(ANY), _srv(ANY, identity), f"{_srv(ANY, identity)}.{ANY}",   # micro serves
           f"_INBOX.{identity}.>"]
    return pub, sub


def permissions(identity: str) -> dict[str, list[str]]:
    """What nats-server allows identity: {"publish": [...], "subscribe": [...]}."""
    pub, sub = control(identity)
    for g in GRANTS:
        if identity in g.pub:
            pub.append(g.pattern)
        if identity in g.sub:
            sub.append(g.pattern)
    return {"publish": list(dict.fromkeys(pub)), "subscribe": list(dict.fromkeys(sub))}
