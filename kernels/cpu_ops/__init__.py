"""CPU ops in C++ (ops.cpp: W8A8 activation passes, the decode attention's K/V gather) when
the extension is built, else the torch reference (ref.py); both give the same bits."""
from __future__ import annotations

import torch

from kernels.cpu_ops.build import load
from kernels.cpu_ops.ref import dequant_rows_ref, gather_heads_f32_ref, quant_rows_ref

__all__ = ["quant_rows", "dequant_rows", "gather_heads_f32", "quant_rows_ref",
           "dequant_rows_ref", "gather_heads_f32_ref", "load"]


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


def gather_heads_f32(cache: torch.Tensor, tables: torch.Tensor, B: int) -> torch.Tensor:
    mod = load()
    if mod is None or cache.is_cuda or not cache.is_contiguous():
        return gather_heads_f32_ref(cache, tables, B)
    return mod.gather_heads_f32(cache, tables, B)
