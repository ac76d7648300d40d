"""Paged-attention decode: Triton on CUDA tensors; on CPU the C++ op (kernels/cpu_ops) when
built, else the torch reference."""
import torch

from kernels._optional import needs_triton
from kernels.cpu_ops import decode_attention
from kernels.paged_attention.ref import DecodePlan, paged_attention_decode_ref, plan_decode

try:        # Triton: the `cuda` extra (pip install "pdmesh[cuda]"); CPU serving runs without it
    from kernels.paged_attention.kernel import paged_attention_decode_triton
except ImportError as e:
    paged_attention_decode_triton = needs_triton(e)

__all__ = ["paged_attention_decode", "paged_attention_decode_ref", "paged_attention_decode_triton",
           "DecodePlan", "plan_decode"]


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, plan: DecodePlan | None = None) -> torch.Tensor:
    # q: [B, Hq, D]; caches: [NB, BS, Hkv, D]; block_tables: [B, max_blocks] int32;
    # context_lens: [B] int32; plan: the CPU path's per-forward gather indices (optional)
    if q.is_cuda:
        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if out is not None:      # C++ (kernels/cpu_ops), read in place
        return out
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      plan)
