"""Decode service settings (flags --foo-bar, env PDMESH_FOO_BAR)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig


@dataclass
class DecodeConfig:
    """pdmesh decode: KV slots, continuous batching, token streaming."""
    model: str = field(default="", metadata={"help": "HF model folder"})
    nats_url: str = "nats://127.0.0.1:4222"
    instance_id: str = field(default="", metadata={"help": "default: generated"})
    mode: str = field(default="auto", metadata={"help": "auto | pd | colocated"})
    min_pd_prompt_tokens: int = field(default=0, metadata={
        "help": "prompts shorter than this are prefilled locally"})
    prefill_timeout_s: float = field(default=30.0, metadata={
        "help": "awaiting KV longer than this: prefill locally instead"})
    prefill_dead_after_s: float = 3.0
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = field(default=0, metadata={"help": "0: from kv_cache_mb"})
    kv_cache_mb: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    chunk_size: int = 256
    deterministic: bool = False
    threads: int = field(default=1, metadata={"help": "torch threads (0: torch default; 1 suits several services per host)"})
    drain_timeout_s: float = 10.0
    reclaim_lease_s: float = field(default=10.0, metadata={
        "help": "an aborted request's blocks stay quarantined at most this long when its "
                "prefill does not answer the reclaim (the epoch fence covers what follows)"})
    reclaim_timeout_s: float = field(default=1.0, metadata={
        "help": "wait this long for a ReclaimAck, then ask again (until the lease ends)"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "L1: reuse prompt blocks still in this instance's KV pool (PD: not sent again)"})
    kvstore: bool = field(default=True, metadata={
        "help": "PD: load a prompt prefix kvstore holds (L2/L3) here, layer by layer, so "
                "prefill sends only the rest"})
    kvstore_timeout_s: float = 2.0
    draft_model: str = field(default="", metadata={
        "help": "speculative decoding: the draft model's HF folder ('' : none)"})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "draft tokens verified per decode step (0: no speculation)"})
    # test-only fault injection (off by default)
    fault_drop_constraint_in_job: bool = field(default=False, metadata={
        "help": "TEST ONLY: send prefill jobs without their constraint"})
    fault_no_reclaim_ack: bool = field(default=False, metadata={
        "help": "TEST ONLY: grant every claim, free aborted blocks at once, send no Reclaim"})
    fault_no_epoch_fence: bool = field(default=False, metadata={
        "help": "TEST ONLY: KV writes land in the blocks they name, whatever their epoch"})

    def __post_init__(self):
        if self.mode not in ("auto", "pd", "colocated"):
            raise ValueError(f"mode must be auto, pd or colocated, got {self.mode!r}")
        if not self.model:
            raise ValueError("--model (PDMESH_MODEL) is required")
        if self.reclaim_lease_s <= 0 or self.reclaim_timeout_s <= 0:
            raise ValueError("reclaim_lease_s and reclaim_timeout_s must be > 0")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            num_blocks=self.num_blocks or None, kv_cache_bytes=self.kv_cache_mb << 20,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunk_size, deterministic=self.deterministic,
            threads=self.threads or None, epoch_fence=not self.fault_no_epoch_fence,
            prefix_caching=self.prefix_cache, draft_model=self.draft_model or None,
            num_speculative_tokens=self.num_speculative_tokens)
