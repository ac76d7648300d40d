"""Prefill service settings (flags --foo-bar, env PDMESH_FOO_BAR)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig


WRITE_POLICIES = ("write_through", "write_through_selective", "none")


@dataclass
class PrefillConfig:
    """pdmesh prefill: prompt forward passes, first token, KV writes to decode."""
    model: str = field(default="", metadata={"help": "HF model folder"})
    nats_url: str = "nats://127.0.0.1:4222"
    instance_id: str = field(default="", metadata={"help": "default: generated"})
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = field(default=0, metadata={"help": "0: from kv_cache_mb"})
    kv_cache_mb: int = 256
    max_jobs: int = field(default=4, metadata={"help": "jobs computed concurrently"})
    max_num_batched_tokens: int = 256
    chunk_size: int = 256
    deterministic: bool = False
    threads: int = field(default=1, metadata={"help": "torch threads (0: torch default; 1 suits several services per host)"})
    kv_window: int = field(default=8, metadata={"help": "KV writes in flight per job (credits)"})
    kv_ack_timeout_s: float = 10.0
    ack_wait_s: float = field(default=10.0, metadata={
        "help": "JetStream ack wait: a job is redelivered if its worker goes silent this long"})
    max_deliver: int = 5
    claim_timeout_s: float = field(default=5.0, metadata={
        "help": "wait this long for decode to grant a job's blocks, else drop the job"})
    kv_max_write_bytes: int = field(default=0, metadata={
        "help": "largest KV write payload (0: the NATS server's max_payload)"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "L1: reuse prompt blocks still in this worker's KV pool"})
    kvstore: bool = field(default=True, metadata={
        "help": "use kvstore (L2 host memory, L3 disk): prefix loads and write-back"})
    write_policy: str = field(default="write_through", metadata={
        "help": "which new prompt blocks go to kvstore: write_through (all, right after the "
                "KV went to decode) | write_through_selective (a prefix seen before) | none"})
    kvstore_timeout_s: float = 2.0
    # test-only fault injection (off by default)
    fault_load_delay_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: each layer loaded from kvstore lands a random 0..this late"})
    fault_no_load_guard: bool = field(default=False, metadata={
        "help": "TEST ONLY: compute reads a loading layer without waiting for it"})
    fault_delay_before_kv_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: sleep this long between computing a job and sending its KV"})
    fault_kv_write_delay_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: each KV write waits a random 0..this long once issued (slow wire)"})

    def __post_init__(self):
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if not self.model:
            raise ValueError("--model (PDMESH_MODEL) is required")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            num_blocks=self.num_blocks or None, kv_cache_bytes=self.kv_cache_mb << 20,
            max_num_seqs=self.max_jobs, max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunk_size, deterministic=self.deterministic,
            threads=self.threads or None, prefix_caching=self.prefix_cache,
            load_guard=not self.fault_no_load_guard)
