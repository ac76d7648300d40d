"""Decode service settings (flags --foo-bar, env PDMESH_FOO_BAR)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.engine.config import EngineConfig

from .faults import REPEAT_LOOP, parse_kinds
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
    # anomaly monitor (invariant 5): only when speculating (draft_model set)
    monitor: bool = field(default=True, metadata={
        "help": "abort a request whose speculative acceptance looks like corrupted state; "
                "the gateway re-dispatches it"})
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
    # test-only fault injection (off by default)
    fault_corrupt_kv: str = field(default="", metadata={
        "help": "TEST ONLY: corrupt selected PD requests' received prompt KV before they "
                "decode: zero_layer, swap, noise (comma-separated; see faults.py)"})
    fault_noise_scale: float = field(default=1.0, metadata={
        "help": "TEST ONLY: noise fault: Gaussian noise of this many times the KV's std"})
    fault_repeat_loop: bool = field(default=False, metadata={
        "help": "TEST ONLY: push selected requests into a repetition loop (logit bias)"})
    fault_select_seed_mod: int = field(default=0, metadata={
        "help": "TEST ONLY: a request whose sampling seed is a multiple of N gets a fault: "
                "kind number (seed / N) mod (number of kinds), kinds as listed above, "
                "repeat_loop last (0: none)"})
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
        self.monitor_config()          # raises on bad thresholds
        parse_kinds(self.fault_corrupt_kv)
        if self.fault_select_seed_mod < 0:
            raise ValueError("fault_select_seed_mod must be >= 0")

    def monitor_config(self) -> MonitorConfig:
        """Thresholds: a flag wins; else the calibration shipped with the draft
        (<draft_model>/monitor.json, made by scripts/bench_monitor.py from clean traffic,
        because what a clean acceptance looks like depends on the draft/target pair);
        else the design defaults (1.4, 0.96)."""
        cal = calibration(self.draft_model)
        return MonitorConfig(min_tokens_low=self.monitor_min_tokens_low,
                             accept_length_low=(self.monitor_accept_length_low
                                                or cal.get("accept_length_low", 1.4)),
                             accept_rate_high=(self.monitor_accept_rate_high
                                               or cal.get("accept_rate_high", 0.96)),
                             min_proposed_high=self.monitor_min_proposed_high,
                             enabled=self.monitor)

    def fault_kinds(self) -> tuple[str, ...]:
        return parse_kinds(self.fault_corrupt_kv) + ((REPEAT_LOOP,) if self.fault_repeat_loop
                                                     else ())

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            num_blocks=self.num_blocks or None, kv_cache_bytes=self.kv_cache_mb << 20,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunk_size, deterministic=self.deterministic,
            threads=self.threads or None, epoch_fence=not self.fault_no_epoch_fence,
            prefix_caching=self.prefix_cache, draft_model=self.draft_model or None,
            num_speculative_tokens=self.num_speculative_tokens)
