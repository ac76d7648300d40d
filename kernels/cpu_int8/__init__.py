"""W8A8 activation ops on the CPU: the C++ extension (ops.cpp) when built, else the torch
reference (ref.py); both give the same bits."""
from __future__ import annotations

import torch

from kernels.cpu_int8.build import load
from kernels.cpu_int8.ref import dequant_rows_ref, quant_rows_ref

__all__ = ["quant_rows", "dequant_rows", "quant_rows_ref", "dequant_rows_ref", "load"]


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
