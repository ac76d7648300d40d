"""float_gemv (kernels/cpu_ops/int8_gemv.cpp): deterministic mode's matmul for a plain
float32 or bfloat16 weight. Each row's result is the same bits alone, in a batch of any
size and with the helper thread sharing the weight rows, so model.linear needs no padded
16-row tiles; and it is the float32 product."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops.gemv import float_gemv, float_gemv_ready, set_batch_helper
from shared.engine import model

pytestmark = pytest.mark.skipif(not float_gemv_ready(), reason="C++ ops without AVX2 here")


@pytest.mark.parametrize("n,k", [(1536, 256), (77, 37)])       # tails of rows and of lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_bits_at_any_batch_and_on_two_threads(n, k, dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(33, k, generator=g).to(dtype)
    got = float_gemv(x, w)
    ref = (x.double() @ w.double().T)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    for m in range(len(x)):
        assert torch.equal(float_gemv(x[m:m + 1], w)[0], got[m]), m
        assert torch.equal(float_gemv(x[:m + 1], w)[m], got[m]), m
    set_batch_helper(True)
    try:
        assert torch.equal(float_gemv(x, w), got)
    finally:
        set_batch_helper(False)


def test_deterministic_linear_takes_it_for_plain_weights_and_tiles_the_rest():
    w = torch.randn(64, 32)
    x = torch.randn(5, 32)
    b = torch.randn(64)
    assert torch.equal(model.linear(x, w, b, tile=16), float_gemv(x, w) + b)
    assert not model._row_invariant(w.T)                     # not contiguous: tiles
    assert not model._row_invariant(w.to(torch.float16))      # no float16 tile: tiles


def test_a_float32_weight_of_bfloat16_values_is_read_as_bfloat16_with_the_same_bits():
    """A checkpoint stored in bfloat16 and served in float32: at a decode step's few rows
    deterministic mode reads its weights as their bfloat16 bits (half the bytes), widened
    back exactly, so each row's result is the float32 weight's bits; at more rows, and for
    a weight with any value bfloat16 cannot hold, the float32 weight itself."""
    g = torch.Generator().manual_seed(5)
    exact = (torch.randn(300, 96, generator=g) * 0.05).to(torch.bfloat16).float()
    inexact = exact.clone()
    inexact[7, 3] += 2 ** -20                                # one value off bfloat16's grid
    x = torch.randn(model.NARROW_ROWS + 4, 96, generator=g)
    for w in (exact, inexact):
        want = float_gemv(x, w.clone())                      # a copy: never narrowed
        for m in range(1, len(x) + 1):
            assert torch.equal(model.linear(x[:m], w, tile=16), want[:m]), m
    assert exact._bf16_exact.dtype == torch.bfloat16         # narrowed, and used
    assert torch.equal(exact._bf16_exact.float(), exact)
    assert inexact._bf16_exact is False                      # never rounded
