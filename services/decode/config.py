"""Decode service settings (flags --foo-bar, env PDMESH_FOO_BAR; the engine's settings
and the test-only faults are nested and flattened: --block-size, --fault-corrupt-kv)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.kv.writeback import WRITE_POLICIES
from shared.natsconn import NatsAuth

from .faults import DecodeFaults
from .monitor import MonitorConfig


def calibration(draft_model: str) -> dict:
    """The monitor thresholds calibrated for a draft (empty when it ships none)."""
    path = Path(draft_model) / "monitor.json" if draft_model else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("thresholds", {})
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _engine() -> EngineConfig:
    return EngineConfig(dtype="bfloat16", kv_cache_mb=512, threads=1)


@dataclass
class DecodeConfig:
    """pdmesh decode: KV slots, continuous batching, token streaming."""
    engine: EngineConfig = field(default_factory=_engine, metadata={"prefix": ""})
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsAuth = field(default_factory=NatsAuth, metadata={"prefix": "nats_"})   # identity, TLS
    otlp_endpoint: str = field(default="", metadata={"help": (
        "OpenTelemetry: export spans over OTLP/HTTP to this collector (http://host:4318); "
        "off when empty")})
    instance_id: str = field(default="", metadata={"help": "default: generated"})
    mode: str = field(default="auto", metadata={"help": "auto | pd | colocated"})
    min_pd_prompt_tokens: int = field(default=0, metadata={
        "help": "prompts shorter than this are prefilled locally"})
    prefill_timeout_s: float = field(default=30.0, metadata={
        "help": "awaiting KV longer than this: prefill locally instead"})
    job_queue_wait_s: float = field(default=1.0, metadata={
        "help": "PD: acknowledge a submission once its prefill job is queued, or after this "
                "long if the job stream cannot take it yet (a leader election after a NATS "
                "node died takes ~10 s, longer than a gateway waits for the acknowledgement); "
                "the job is queued as soon as the stream answers, else prefilled here"})
    prefill_dead_after_s: float = 3.0
    require_prefill: bool = field(default=False, metadata={
        "help": "ready (heartbeat, the gateway's /ready) only while a prefill worker is "
                "alive: set when the mesh has prefill workers, so PD is usable before "
                "the first request (pdmesh up sets it)"})
    gateway_dead_after_s: float = field(default=5.0, metadata={
        "help": "a gateway silent this long is gone: its requests are aborted (orphans)"})
    max_queued: int = field(default=64, metadata={
        "help": "requests waiting for a batch slot or for their KV beyond this: refused "
                "as overloaded (the gateway tries another instance, else answers 429)"})
    drain_timeout_s: float = 10.0
    reclaim_lease_s: float = field(default=10.0, metadata={
        "help": "an aborted request's blocks stay quarantined at most this long when its "
                "prefill does not answer the reclaim (the epoch fence covers what follows)"})
    reclaim_timeout_s: float = field(default=1.0, metadata={
        "help": "wait this long for a ReclaimAck, then ask again (until the lease ends)"})
    kvstore: bool = field(default=True, metadata={
        "help": "PD: load a prompt prefix kvstore holds (L2/L3) here, layer by layer, so "
                "prefill sends only the rest"})
    kvstore_timeout_s: float = 2.0
    write_policy: str = field(default="write_through", metadata={
        "help": "a prompt decode computed itself (colocated) goes to kvstore, so the next "
                "request with its prefix hits on either path: write_through | "
                "write_through_selective | none"})
    # anomaly monitor (invariant 5): acceptance rules while a draft model speculates,
    # the repetition rule always
    monitor: bool = field(default=True, metadata={
        "help": "abort a request whose speculative acceptance looks like corrupted state, or "
                "whose output loops; the gateway re-dispatches it (a loop with a fresh sample)"})
    monitor_repeat_window: int = field(default=128, metadata={
        "help": "repetition: the last this many generated tokens one span repeated "
                "(0: the rule off)"})
    monitor_repeat_max_period: int = field(default=64, metadata={
        "help": "repetition: the longest span (tokens) whose repeats count as a loop"})
    monitor_repeat_min_copies: int = field(default=3, metadata={
        "help": "repetition: how many times a span repeats at least to count as a loop (a "
                "span longer than window / copies is judged over copies x its length)"})
    monitor_accept_length_low: float = field(default=0.0, metadata={
        "help": "low_accept_length: mean accept length (accepted + steps) / steps below this "
                "(0: the draft folder's monitor.json calibration, else 1.4)"})
    monitor_min_tokens_low: int = field(default=128, metadata={
        "help": "low_accept_length: only once more than this many tokens were generated"})
    monitor_accept_rate_high: float = field(default=0.0, metadata={
        "help": "high_accept_rate: accepted / proposed drafts above this "
                "(0: the draft folder's monitor.json calibration, else 0.96)"})
    monitor_min_proposed_high: int = field(default=128, metadata={
        "help": "high_accept_rate: only once at least this many drafts were proposed"})
    faults: DecodeFaults = field(default_factory=DecodeFaults, metadata={"prefix": "fault_"})

    def __post_init__(self):
        if self.mode not in ("auto", "pd", "colocated"):
            raise ValueError(f"mode must be auto, pd or colocated, got {self.mode!r}")
        if not self.engine.model:
            raise ValueError("--model (PDMESH_MODEL) is required")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, "
                             f"got {self.write_policy!r}")
        if self.job_queue_wait_s < 0:
            raise ValueError("job_queue_wait_s must be >= 0")
        if self.reclaim_lease_s <= 0 or self.reclaim_timeout_s <= 0:
            raise ValueError("reclaim_lease_s and reclaim_timeout_s must be > 0")
        self.monitor_config()          # raises on bad thresholds

    @property
    def model(self) -> str:
        return self.engine.model

    def monitor_config(self) -> MonitorConfig:
        """Thresholds: a flag wins; else the calibration shipped with the draft
        (<draft_model>/monitor.json, made by scripts/bench_monitor.py from clean traffic,
        because what a clean acceptance looks like depends on the draft/target pair);
        else the design defaults (1.4, 0.96)."""
        cal = calibration(self.engine.draft_model)
        return MonitorConfig(min_tokens_low=self.monitor_min_tokens_low,
                             accept_length_low=(self.monitor_accept_length_low
                                                or cal.get("accept_length_low", 1.4)),
                             accept_rate_high=(self.monitor_accept_rate_high
                                               or cal.get("accept_rate_high", 0.96)),
                             min_proposed_high=self.monitor_min_proposed_high,
                             enabled=self.monitor,
                             # n-gram acceptance measures how much text repeats itself,
                             # not the state: only a draft model's acceptance is judged
                             spec_rules=bool(self.engine.draft_model) and self.engine.speculative,
                             repeat_window=self.monitor_repeat_window,
                             repeat_max_period=self.monitor_repeat_max_period,
                             repeat_min_copies=self.monitor_repeat_min_copies)
