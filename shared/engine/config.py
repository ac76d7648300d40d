"""Engine settings: one slotted dataclass that checks itself."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None        # set this or kv_cache_bytes
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 16               # running sequences per step
    max_num_batched_tokens: int = 256    # rows per forward
    chunk_size: int = 256                # prefill chunk (tokens of one sequence per step)
    deterministic: bool = False          # batch-invariant logits (fixed-shape forwards)
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    threads: int | None = None           # torch intra-op threads
    epoch_fence: bool = True             # False: TEST ONLY, remote KV writes land unchecked
    prefix_caching: bool = True          # L1: reuse whole prompt blocks already in the pool
    load_guard: bool = True              # False: TEST ONLY, compute reads loading layers unchecked
    load_timeout_s: float = 30.0         # a layer load slower than this fails (recomputed)
    draft_model: str | None = None       # speculative decoding: the draft's HF folder
    num_speculative_tokens: int = 4      # drafts verified per decode step (0 disables)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.chunk_size < 1 or self.max_num_batched_tokens < self.chunk_size:
            raise ValueError("need 1 <= chunk_size <= max_num_batched_tokens")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0 (0 disables speculation)")
        if self.speculative and self.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError("num_speculative_tokens must be < max_num_batched_tokens "
                             "(a decode step verifies 1 + num_speculative_tokens rows)")

    @property
    def speculative(self) -> bool:
        return bool(self.draft_model) and self.num_speculative_tokens > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
