"""Torch reference of the C++ CPU ops (ops.cpp); also the path when the C++
extension is off or could not be built."""
from __future__ import annotations

import torch


def quant_rows_ref(x: torch.Tensor, inv: torch.Tensor | None = None, u8: bool = False):
    """(int8 codes [M, K], float32 scales [M, 1]) of x (times inv, in x's dtype); u8: the
    codes + 128 as uint8 (oneDNN's u8 activations, zero point 128)."""
    if inv is not None:
        x = x * inv.to(x.dtype)
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8) / 127.0
    q = torch.round(xf / sx).clamp_(-127, 127)
    return (q.add_(128).to(torch.uint8) if u8 else q.to(torch.int8)), sx


def dequant_rows_ref(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] int32 (or float32) times sx[m] * sw[n] (float32), in dtype."""
    return (acc * (sx * sw)).to(dtype)

