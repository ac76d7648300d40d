"""A plain bfloat16 weight on a CPU without bfloat16 dot products (no AVX512-BF16, no AMX):
from 8 rows on (32 for a weight as large as an LM head), model.linear multiplies in float32
and rounds once (torch's bfloat16 GEMM runs 2-7x slower there). The answer is the bfloat16 GEMM's within the order of the sum:
the products are exact in float32 either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine import model
from shared.engine.model import linear

pytestmark = pytest.mark.skipif(model.NATIVE_BF16, reason="this CPU has bfloat16 dot "
                                "products: torch's bfloat16 GEMM serves")


def _case(rows: int, bias: bool = False):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(1536, 576, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    b = torch.randn(1536, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [8, 16, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_of_a_bf16_weight_are_summed_in_float32_and_rounded_once(rows, bias):
    x, w, b = _case(rows, bias)
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # torch's own bfloat16 GEMM: the same products, summed in another order (a 1-ulp
    # difference in a few outputs of 10,000 at most)
    ref = F.linear(x, w, b)
    close = torch.isclose(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    assert close.all(), (got.float() - ref.float()).abs().max()


def test_few_rows_keep_torchs_kernels_where_widening_the_weight_costs_more():
    x, w, _ = _case(1)
    assert torch.equal(linear(x, w), torch.mv(w, x[0]).unsqueeze(0))
    x, w, _ = _case(4)
    assert torch.equal(linear(x, w), F.linear(x, w))
    head = torch.zeros(model.BIG_WEIGHT // 64, 64, dtype=torch.bfloat16)
    assert not model._f32_rows(x.new_zeros(16, 64), head)
    assert model._f32_rows(x.new_zeros(32, 64), head)
