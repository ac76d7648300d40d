"""act_int8 (shared/engine/quant.py): forwards of A8_MIN_ROWS rows or more multiply on int8
activations (W8A8, torch._int_mm); fewer rows keep the weight-only kernels exactly."""
from __future__ import annotations

import torch

from shared.engine import quant
from shared.engine.quant import Int4Weight, Int8Weight, quantize_weight


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    err = (got.float() - ref.float()).abs()
    return bool(err.max() < tol * ref.abs().max() and err.mean() < tol * ref.abs().mean())


def test_w8a8_rows_are_close_and_few_rows_keep_the_weight_only_kernel():
    torch.manual_seed(0)
    w = (torch.randn(512, 576) * 0.05).to(torch.bfloat16)
    x = torch.randn(16, 576).to(torch.bfloat16)
    plain8, a8 = Int8Weight(w), Int8Weight(w, a8=True)
    got = a8.mm(x)
    assert got.shape == (16, 512) and got.dtype == x.dtype
    assert _close(got, x.float() @ plain8.dequantize().float().T, 0.02)   # 8-bit rows
    plain4, a8_4 = Int4Weight(w), Int4Weight(w, a8=True)
    assert torch.equal(a8_4.mm(x), got)          # int4's batches: its int8 copy, on W8A8
    few = x[:quant.A8_MIN_ROWS - 1]
    assert torch.equal(a8.mm(few), plain8.mm(few))      # few rows: the weight-only kernels
    assert torch.equal(a8_4.mm(few), plain4.mm(few))


def test_act_int8_reaches_every_linear_and_the_head():
    w = torch.randn(64, 64)
    assert quantize_weight(w, "int4", head=True, a8=True).a8
    assert quantize_weight(w, "int8", a8=True).a8
    assert quantize_weight(w, "int4", a8=True).i8 is not None
    assert not quantize_weight(w, "int8").a8 and quantize_weight(w, "int4").i8 is None
