"""Control messages between services (msgspec JSON, readable with `nats sub 'pdmesh.>'`).

Top-level messages carry `v`; new fields are added only with defaults.
"""
from __future__ import annotations

import enum

import msgspec

from .common import VERSION, ErrorReply
from .constraint import Constraint
from .sampling import SamplingParams


class Path(str, enum.Enum):
    PD = "pd"
    COLOCATED = "colocated"


class FinishReason(str, enum.Enum):
    """Why a request ended. On the wire TokenChunk.finish_reason stays a plain string;
    TOOL_CALLS is the gateway's, for an answer that called tools."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"
    PREFILL_DONE = "prefill_done"    # engine-internal: a prefill-only request's first token


class DecodeSubmit(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """gateway -> decode: serve this request, stream TokenChunks to reply_subject."""
    v: int = VERSION
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams            # seed always resolved by the gateway
    constraint: Constraint = Constraint()
    tokenizer_fingerprint: str
    reply_subject: str
    force_path: Path | None = None    # None: decode decides
    gateway: str = ""                 # the gateway's instance id: its requests are aborted
    #                                   when it stops heartbeating (orphans)
    resume_from: int = 0              # migration: the last resume_from prompt tokens are
    #                                   output already streamed (the grammar replays them)
    cache_salt: str = ""              # tenant of the prefix cache: mixed into every prefix
    #                                   key (L1, L2, L3), so tenants never share KV blocks


class SubmitAck(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    path: Path
    incarnation: str = ""             # the accepting process (Heartbeat.incarnation)


class KvDestination(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Where prefill writes: decode instance, its blocks, and each block's epoch.
    skip_blocks: leading prompt blocks decode already holds (its prefix cache); block_ids
    receive the prompt's blocks from there on."""
    instance_id: str
    block_ids: list[int]
    epochs: list[int]
    skip_blocks: int = 0


class PrefillJob(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """decode -> (JetStream) -> prefill. Carries everything that affects generation."""
    v: int = VERSION
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    constraint: Constraint = Constraint()
    tokenizer_fingerprint: str
    model: str
    block_size: int
    dest: KvDestination
    issued_at: float = 0.0
    resume_from: int = 0              # DecodeSubmit.resume_from: the grammar replays them
    cache_salt: str = ""              # DecodeSubmit.cache_salt: prefill's prefix keys too
    kvstore_blocks: int | None = None  # leading prompt blocks kvstore held when decode looked
    #                                    (None: it did not): prefill loads them without asking
    #                                    again; one evicted since is recomputed


class PrefillStatus(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"


class PrefillDone(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """prefill -> decode, once no KV write of the attempt is in flight: OK after every
    write was acknowledged, FAILED otherwise (writes_issued still counts every write sent,
    so decode knows how many may still land)."""
    v: int = VERSION
    request_id: str
    status: PrefillStatus
    prefill_instance: str
    first_token: int | None = None
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[int, float]] | None = None
    writes_issued: int = 0
    bytes_sent: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    error: ErrorReply | None = None
    attempt: str = ""                 # PrefillClaim.attempt
    cached_tokens: int = 0            # prompt tokens served from a prefix cache (not computed)


class TokenChunk(msgspec.Struct, tag=True, frozen=True, kw_only=True, omit_defaults=True):
    """decode -> gateway: new tokens of one request (one chunk per engine step)."""
    v: int = VERSION
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] = []
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    path: Path | None = None
    error: ErrorReply | None = None
    seq: int = 0                      # per request, from 0: a gap means a lost chunk
    cached_tokens: int = 0            # prompt tokens served from a prefix cache
    # speculative decoding, cumulative for the request (0 when it did not speculate):
    # verification steps, drafts proposed, drafts accepted
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    anomaly_rule: str = ""            # with error ANOMALY: the monitor rule that fired
    # final chunk, seconds on decode's clock (vLLM's request phases): accepted -> its prompt
    # began (a prefill claim, or its first step here), -> first token, -> this chunk
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class AnomalyEvent(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """decode -> pdmesh.evt.request.anomaly: the speculative monitor aborted a request
    (invariant 5). accept_length = (accepted + steps) / steps, accept_rate = accepted /
    proposed, both over the request so far."""
    v: int = VERSION
    request_id: str
    instance_id: str
    rule: str                         # services.decode.monitor.Rule
    accept_length: float
    accept_rate: float
    generated_tokens: int
    ts: float = 0.0


class AbortReason(str, enum.Enum):
    """Why a request was aborted (Abort.reason; the gateway also sends its error codes)."""
    CLIENT = "client"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    ANOMALY = "anomaly"
    REPLAY_ERROR = "replay_error"
    START_ERROR = "start_error"
    ENGINE_ERROR = "engine_error"
    PREFILL_FAILED = "prefill_failed"
    PREFILL_TIMEOUT = "prefill_timeout"
    GATEWAY_LOST = "gateway_lost"
    DISPATCH_FAILED = "dispatch_failed"


class Abort(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    reason: str = AbortReason.CLIENT.value


class ProgressQuery(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """gateway -> decode: how many TokenChunks of this request have you sent? Asked by a
    request that has heard nothing for a while (services/gateway/probe.py)."""
    v: int = VERSION
    request_id: str


class ProgressReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    sent: int                          # TokenChunks sent (the next one's seq); -1: this
    #                                    instance is not serving the request (ended or unknown)


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    service: str
    instance_id: str
    model: str = ""
    tokenizer_fingerprint: str = ""
    running: int = 0
    waiting: int = 0
    queue_depth: int = 0
    blocks_free: int = 0
    blocks_used: int = 0
    blocks_quarantined: int = 0       # decode: aborted requests' blocks awaiting reclaim
    accepting: bool = True            # False while draining: send no new work
    capacity: int = 0                 # decode: requests it batches at once (max_num_seqs)
    ready: bool = True                # decode: every path it is set up for is usable now
    #                                   (require_prefill: a prefill worker heartbeats)
    max_model_len: int = 0
    host: str = ""                    # what shares /dev/shm with it (shared/kv/shm.host_id):
    #                                   a prefill on the same host writes KV through memory
    ts: float = 0.0
    incarnation: str = ""             # random per process: a restart under the same
    #                                   instance_id is a new one (its requests are gone)
    shm_segment: str = ""             # prefill: its KV shared-memory segment; decode reads
    #                                   no other segment for it (shared/kv/shm.py)


class Health(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    service: str
    instance_id: str
    ok: bool = True
