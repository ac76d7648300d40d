"""Prefill service settings (flags --foo-bar, env PDMESH_FOO_BAR; the engine's settings
and the test-only faults are nested and flattened: --block-size, --fault-load-delay-s)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig
from shared.kv.writeback import WRITE_POLICIES
from shared.natsconn import NatsAuth

from .faults import PrefillFaults
from .layersplit.config import LayerSplitConfig


def _engine() -> EngineConfig:
    # max_num_seqs: the jobs computed concurrently
    return EngineConfig(dtype="bfloat16", kv_cache_mb=256, threads=1, max_num_seqs=4)


@dataclass
class PrefillConfig:
    """pdmesh prefill: prompt forward passes, first token, KV writes to decode."""
    engine: EngineConfig = field(default_factory=_engine, metadata={"prefix": ""})
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsAuth = field(default_factory=NatsAuth, metadata={"prefix": "nats_"})   # identity, TLS
    otlp_endpoint: str = field(default="", metadata={"help": (
        "OpenTelemetry: export spans over OTLP/HTTP to this collector (http://host:4318); "
        "off when empty")})
    instance_id: str = field(default="", metadata={"help": "default: generated"})
    kv_window: int = field(default=8, metadata={"help": "KV writes in flight per job (credits)"})
    kv_ack_timeout_s: float = 10.0
    ack_wait_s: float = field(default=10.0, metadata={
        "help": "JetStream ack wait: a job is redelivered if its worker goes silent this long"})
    max_deliver: int = 5
    claim_timeout_s: float = field(default=5.0, metadata={
        "help": "wait this long for decode to grant a job's blocks, else drop the job"})
    kv_max_write_bytes: int = field(default=0, metadata={
        "help": "largest KV write payload (0: 2 MiB across the network, which pipelines "
                "with the wire; the NATS server's max_payload through shared memory)"})
    kv_shm: bool = field(default=True, metadata={
        "help": "KV to a decode instance on the same host through shared memory (NATS carries "
                "only the handle, checksum and epochs); off: every byte over NATS"})
    kv_shm_mb: int = field(default=256, metadata={
        "help": "the shared-memory segment for same-host KV writes (/dev/shm)"})
    kv_stream: str = field(default="auto", metadata={
        "help": "layer-wise KV streaming: each layer's KV of each chunk of a prompt longer "
                "than one chunk goes to decode as soon as it is computed, while the later "
                "layers compute, instead of the whole prompt's KV after the compute. auto: "
                "per job, when the KV's wire time to its decode (the link rate this prefill "
                "measured) is at least --kv-stream-min-share of the prompt's compute time; "
                "on | off: always | never. Never to a same-host decode through shared "
                "memory unless --kv-stream-shm (docs/bench/kv_link.*)"})
    kv_stream_min_share: float = field(default=0.05, metadata={
        "help": "kv_stream=auto streams when wire time / compute time is at least this"})
    kv_stream_shm: bool = field(default=False, metadata={
        "help": "with --kv-stream, stream through shared memory too (its wire time is near "
                "zero: the per-layer writes only add work)"})
    kvstore: bool = field(default=True, metadata={
        "help": "use kvstore (L2 host memory, L3 disk): prefix loads and write-back"})
    write_policy: str = field(default="write_through", metadata={
        "help": "which new prompt blocks go to kvstore: write_through (all, right after the "
                "KV went to decode) | write_through_selective (a prefix seen before) | none"})
    kvstore_timeout_s: float = 2.0
    group: LayerSplitConfig = field(default_factory=LayerSplitConfig,   # LayerSplit: --group-*
                                    metadata={"prefix": "group_"})
    faults: PrefillFaults = field(default_factory=PrefillFaults, metadata={"prefix": "fault_"})

    def __post_init__(self):
        if isinstance(self.kv_stream, bool):      # kv_stream=true|false (config files, env)
            self.kv_stream = "on" if self.kv_stream else "off"
        self.kv_stream = {"true": "on", "false": "off"}.get(str(self.kv_stream).lower(),
                                                             str(self.kv_stream).lower())
        if self.kv_stream not in ("auto", "on", "off"):
            raise ValueError(f"kv_stream must be auto, on or off, got {self.kv_stream!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, "
                             f"got {self.write_policy!r}")
        if not self.engine.model:
            raise ValueError("--model (PDMESH_MODEL) is required")

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def max_jobs(self) -> int:
        return self.engine.max_num_seqs
