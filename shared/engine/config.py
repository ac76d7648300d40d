"""Engine settings: one slotted dataclass that checks itself.

It is nested in every engine-hosting service's settings (decode, prefill), whose loader
flattens it into the service's flags and env vars (--block-size, PDMESH_BLOCK_SIZE, ...);
each service only changes the defaults that suit it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .quant import MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _h(text: str) -> dict:
    return {"help": text}


@dataclass(slots=True)
class EngineConfig:
    model: str = field(default="", metadata=_h(
        "HF model folder, or a Hugging Face id (org/name[@revision]) in the local cache"))
    dtype: str = field(default="float32", metadata=_h("float32 | bfloat16 | float16"))
    block_size: int = field(default=16, metadata=_h("tokens per KV block"))
    num_blocks: int = field(default=0, metadata=_h("KV blocks (0: from kv_cache_mb)"))
    kv_cache_mb: int = field(default=256, metadata=_h("KV pool size when num_blocks is 0"))
    max_num_seqs: int = field(default=16, metadata=_h("running sequences per step"))
    max_num_batched_tokens: int = field(default=256, metadata=_h("rows per forward"))
    chunk_size: int = field(default=256, metadata=_h(
        "prefill chunk: tokens of one sequence per step"))
    deterministic: bool = field(default=False, metadata=_h(
        "batch-invariant logits (every matmul row by row in a fixed order: the C++ float_gemv "
        "for plain CPU weights, else fixed 16-row tiles): output independent of the batch"))
    max_model_len: int = field(default=0, metadata=_h(
        "context window (0: the model's max_position_embeddings)"))
    threads: int = field(default=0, metadata=_h("torch intra-op threads (0: torch default)"))
    device: str = field(default="cpu", metadata=_h(
        "cpu | cuda | cuda:N: where the weights, the KV pool and the forward live"))
    quantize: str = field(default="", metadata=_h(
        "weight-only quantization of the linear layers: '' (none) | int8 | int4 | auto "
        "(a GGUF's own precision: Q4_x int4, Q5-Q8 int8, F16/BF16/F32 none; int4 for any "
        "other folder)"))
    act_int8: bool = field(default=False, metadata=_h(
        "with quantize: forwards of 6 rows or more (prefill, batched decode) multiply the "
        "attention output, gate|up and the LM head on int8 activations too (W8A8 on int8 "
        "dot products, per-row dynamic scales), as llama.cpp does with Q8 activations; "
        "int4 keeps an int8 copy of those weights"))
    smoothquant: bool = field(default=False, metadata=_h(
        "with act_int8: q|k|v and down on int8 activations too, after SmoothQuant "
        "(per-channel smoothing calibrated at load over a fixed built-in text, ~1,100 "
        "tokens; smooth.py), for faster batches and prefill; CPU only"))
    head_split: bool = field(default=False, metadata=_h(
        "with quantize: decode steps of 1-2 rows multiply the two halves of the LM head "
        "on two threads (the step is bandwidth-bound on one core and the head is its "
        "largest weight; a second core idle at low concurrency reads half of it)"))
    batch_helper: bool = field(default=False, metadata=_h(
        "with quantize on a CPU the C++ ops run on (AVX2 or AVX512-BF16): decode's int4 "
        "matmuls and the int8 LM head's share their work with a helper thread (head_split "
        "then keeps to one thread), which takes it as it gets a core (pdmesh up's decode: "
        "prefill's core, idle while no long prompt runs)"))
    prefix_cache: bool = field(default=True, metadata=_h(
        "L1: reuse whole prompt blocks still in this engine's KV pool"))
    # False: TEST ONLY, compute reads a loading layer unchecked (prefill's
    # --fault-no-load-guard sets it; never a flag of its own)
    load_guard: bool = field(default=True, metadata={"flag": False})
    load_timeout_s: float = field(default=30.0, metadata=_h(
        "a layer load slower than this fails (the blocks are recomputed)"))
    draft_model: str = field(default="", metadata=_h(
        "speculative decoding: the draft model's HF folder ('': none)"))
    spec_method: str = field(default="", metadata=_h(
        "speculative decoding's drafter: '' (the draft_model, if set) | ngram (drafts from "
        "the sequence's own earlier tokens, vLLM's ngram / prompt lookup; no model)"))
    num_speculative_tokens: int = field(default=4, metadata=_h(
        "draft tokens verified per decode step at most (0: no speculation)"))
    draft_quantize: str = field(default="int8", metadata=_h(
        "the draft's weights: int8 | int4 | none | '' (as quantize); drafts only propose, the "
        "target verifies, so this changes speed and accept rates, never what is accepted"))
    spec_adaptive: bool = field(default=True, metadata=_h(
        "choose each step's drafts (0..num_speculative_tokens) from the measured forward "
        "costs and accept rates (never in deterministic mode)"))
    spec_max_batch: int = field(default=0, metadata=_h(
        "adaptive speculation drafts only while at most this many sequences decode; a larger "
        "batch decodes plainly and runs no draft (0: no limit, vLLM's default for its "
        "speculative_disable_by_batch_size). The anomaly monitor sees only steps that "
        "drafted, so a limit trades detection for speed"))

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.quantize not in (*MODES, "auto"):
            raise ValueError(f"quantize must be '', 'int8', 'int4' or 'auto', "
                             f"got {self.quantize!r}")
        if self.smoothquant and not (self.quantize and self.act_int8):
            raise ValueError("smoothquant needs quantize (int8 or int4) and act_int8")
        if self.draft_quantize not in (*MODES, "none"):
            raise ValueError(f"draft_quantize must be '', none, int8 or int4, "
                             f"got {self.draft_quantize!r}")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.chunk_size < 1 or self.max_num_batched_tokens < self.chunk_size:
            raise ValueError("need 1 <= chunk_size <= max_num_batched_tokens")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_blocks < 0 or self.kv_cache_mb < 0 or self.threads < 0:
            raise ValueError("num_blocks, kv_cache_mb and threads must be >= 0")
        if self.spec_method not in ("", "ngram"):
            raise ValueError(f"spec_method must be '' or 'ngram', got {self.spec_method!r}")
        if self.spec_method == "ngram" and self.draft_model:
            raise ValueError("spec_method ngram drafts without a model: drop draft_model")
        if self.spec_max_batch < 0:
            raise ValueError("spec_max_batch must be >= 0 (0: no limit)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0 (0 disables speculation)")
        if self.speculative and self.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError("num_speculative_tokens must be < max_num_batched_tokens "
                             "(a decode step verifies 1 + num_speculative_tokens rows)")

    def with_quantize(self, mode: str) -> EngineConfig:
        """This config with quantize resolved to mode ('' drops what needs quantize:
        act_int8, smoothquant, head_split)."""
        from dataclasses import replace
        if mode:
            return replace(self, quantize=mode)
        return replace(self, quantize="", act_int8=False, smoothquant=False, head_split=False,
                       batch_helper=False)

    @property
    def speculative(self) -> bool:
        return (bool(self.draft_model) or self.spec_method == "ngram") and \
            self.num_speculative_tokens > 0

    @property
    def draft_quant(self) -> str:
        """The draft's quantization ('' = none)."""
        q = self.quantize if self.draft_quantize == "" else self.draft_quantize
        return "" if q == "none" else q

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_mb << 20
