"""CPU ops in C++ (ops.cpp) when the extension is built: W8A8 activation passes (else the
torch reference, ref.py, with the same bits), decode attention read in place, RMSNorm and
RoPE in one call each (else None: the caller's torch path serves); the few-row int4/int8
matmuls are in gemv.py."""
from __future__ import annotations

import torch

from kernels.cpu_ops.build import load
from kernels.cpu_ops.ref import dequant_rows_ref, quant_rows_ref

__all__ = ["quant_rows", "dequant_rows", "quant_rows_ref", "dequant_rows_ref",
           "decode_attention", "row_attention", "rows_attention", "rms_norm", "rope", "silu_mul",
           "load"]


def quant_rows(x: torch.Tensor, inv: torch.Tensor | None = None, u8: bool = False):
    mod = load()
    if mod is None or x.is_cuda:
        return quant_rows_ref(x, inv, u8)
    return mod.quant_rows(x, inv, u8)


def dequant_rows(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    mod = load()
    if mod is None or acc.is_cuda:
        return dequant_rows_ref(acc, sx, sw, dtype)
    return mod.dequant_rows(acc, sx, sw, dtype)


def _in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (not q.is_cuda and k.is_contiguous() and v.is_contiguous()
            and k.dtype == q.dtype == v.dtype)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """Decode attention read in place from the paged cache (ops.cpp: paged_decode), or None
    where the extension is off or the inputs do not suit it (the caller's torch path
    serves). Float32 math: the torch path's result up to the last bits."""
    mod = load()
    if mod is None or not _in_place(q, k_cache, v_cache):
        return None
    return mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def row_attention(q, kf, vf, slots: torch.Tensor, scale: float):
    """One decode row q [Hq, D] over flat slots of kf/vf [NS, Hkv, D] (ops.cpp:
    slots_decode) -> [Hq, D], or None (as decode_attention)."""
    mod = load()
    if mod is None or not _in_place(q, kf, vf):
        return None
    return mod.slots_decode(q, kf, vf, slots, scale)


def rows_attention(q, kf, vf, slots: torch.Tensor, scale: float):
    """The last n rows of a sequence, q [n, Hq, D], each attended exactly as row_attention
    attends it alone (ops.cpp: slots_causal) -> [n, Hq, D], or None (as decode_attention)."""
    mod = load()
    if mod is None or not _in_place(q, kf, vf):
        return None
    return mod.slots_causal(q, kf, vf, slots, scale)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool):
    """Model.rms_norm of x [T, H] in one call (fused.cpp), or None (extension off, CUDA,
    another layout or dtype: the caller's torch path serves)."""
    mod = load()
    if (mod is None or x.is_cuda or x.dim() != 2 or not x.is_contiguous()
            or x.dtype not in (torch.float32, torch.bfloat16)
            or w.dtype not in (x.dtype, torch.float32)):
        return None
    return mod.rms_norm(x, w, eps, gemma)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """Model.rope of x [T, heads, D] in one call, the same bits (fused.cpp), or None (as
    rms_norm)."""
    mod = load()
    rows = (x.shape[0], 1, x.shape[2]) if x.dim() == 3 else None
    if (mod is None or x.is_cuda or rows is None or x.stride(-1) != 1 or x.shape[2] % 2
            or x.dtype not in (torch.float32, torch.bfloat16)
            or any(t.dtype != x.dtype or tuple(t.shape) != rows or not t.is_contiguous()
                   for t in (cos, sin))):
        return None
    return mod.rope(x, cos, sin, interleaved)


def silu_mul(x: torch.Tensor):
    """silu(gate) * up of gate|up [T, 2I] in one call (fused.cpp), or None (as rms_norm)."""
    mod = load()
    if (mod is None or x.is_cuda or x.dim() != 2 or not x.is_contiguous()
            or x.dtype not in (torch.float32, torch.bfloat16)):
        return None
    return mod.silu_mul(x)
