"""The C++ matmuls of a few rows that decode steps run on (kernels/cpu_ops/int4_gemv.cpp,
int8_gemv.cpp): the int4 layout, their sums against torch, and each row's result
independent of the other rows (a speculative verify must see what a decode step sees)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops.gemv import (
    AVX2_GEMV_MAX_ROWS,
    GEMM_MAX_ROWS,
    GEMV_MAX_ROWS,
    INT8_GEMV_MAX_ROWS,
    Int4Packed,
    batch_ready,
    gemv_pack,
    gemv_ready,
    gemv_unpack,
    int4_dequant,
    int4_gemv,
    int4_gemv_ref,
    int8_gemv,
    int8_gemv_ready,
)
from shared.engine.quant import Int4Weight, Int8Weight, int4_codes

needs_simd = pytest.mark.skipif(not gemv_ready(), reason="C++ ops without AVX512-BF16 or AVX2 here")
needs_simd8 = pytest.mark.skipif(not int8_gemv_ready(), reason="C++ ops without AVX-512 or AVX2 here")
SHAPES = [(960, 576), (577, 1536), (6, 64)]   # SmolLM2's qkv and down; tails of rows and groups


def weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s, z = int4_codes(torch.randn(n, k, generator=g) * 0.05)
    return gemv_pack(q), s[..., 0].to(torch.bfloat16).contiguous(), z[..., 0].to(torch.bfloat16).contiguous()


def test_the_packing_round_trips_and_puts_two_groups_in_each_byte():
    q = torch.randint(0, 16, (5, 128), generator=torch.Generator().manual_seed(1))
    codes = gemv_pack(q)
    assert codes.shape == (5, 64) and codes.dtype == torch.uint8
    assert torch.equal(gemv_unpack(codes), q.to(torch.int32))
    assert int(codes[0, 3]) == int(q[0, 3]) | int(q[0, 35]) << 4     # byte i: inputs i, 32 + i


@needs_simd
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_the_reference(n, k, dtype):
    codes, s, z = weight(n, k)
    x = torch.randn(GEMV_MAX_ROWS, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, ref = int4_gemv(x, codes, s, z), int4_gemv_ref(x, codes, s, z)
    assert got.dtype == dtype and got.shape == (GEMV_MAX_ROWS, n)
    # float32 sums in another order (and the 128 + q trick): float32 noise, or one
    # bfloat16 rounding step where the output is bfloat16
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@needs_simd
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_result_does_not_depend_on_the_other_rows(n, k):
    """Bit for bit: row m alone, or among 2..GEMV_MAX_ROWS rows, at any position."""
    codes, s, z = weight(n, k)
    x = torch.randn(GEMV_MAX_ROWS, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([int4_gemv(x[m:m + 1], codes, s, z) for m in range(GEMV_MAX_ROWS)])
    for rows in range(2, GEMV_MAX_ROWS + 1):
        assert torch.equal(int4_gemv(x[:rows], codes, s, z), alone[:rows]), rows
    assert torch.equal(int4_gemv(x.flip(0), codes, s, z), alone.flip(0))


@needs_simd
def test_dequant_is_the_weight_to_bfloat16_rounding():
    codes, s, z = weight(64, 576)
    q = gemv_unpack(codes).float().reshape(64, 18, 32)
    ref = ((q - 8.0) * s.float()[..., None] + z.float()[..., None]).reshape(64, 576)
    got = int4_dequant(codes, s, z)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref.to(torch.bfloat16))


@needs_simd
def test_int4_weight_runs_on_the_kernel_and_agrees_with_its_dequantized_weight():
    """Decode rows on int4_gemv, prefill rows on the bfloat16 GEMM: both x @ w.T for the
    same w."""
    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(4)) * 0.05
    lin = Int4Weight(w)
    assert isinstance(lin.gemv, Int4Packed) and lin.packed is None
    wd = lin.dequantize().float()
    assert (wd - w).abs().max() < 0.02
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, GEMM_MAX_ROWS, GEMM_MAX_ROWS + 1):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        ref = x.to(torch.bfloat16).float() @ wd.T
        assert torch.allclose(lin.mm(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()), rows


@needs_simd
@pytest.mark.skipif(batch_ready(), reason="AVX2 builds only (no int4_gemm)")
def test_on_avx2_a_decode_batch_row_is_its_decode_step_and_prefill_gets_the_same_weight():
    """No int4_gemm there: int4_gemv up to AVX2_GEMV_MAX_ROWS rows, so a row of such a
    batch is the bits of that row alone; more rows multiply float32 on int4_dequant's
    values (the bfloat16 weight's)."""
    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(6)) * 0.05
    lin = Int4Weight(w)
    x = torch.randn(AVX2_GEMV_MAX_ROWS, 576, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([lin.mm(x[m:m + 1]) for m in range(AVX2_GEMV_MAX_ROWS)])
    assert torch.equal(lin.mm(x), alone)
    g = lin.gemv
    f32 = int4_dequant(g.codes, g.scale, g.zero, torch.empty(96 * 576 + 5))
    assert torch.equal(f32.to(torch.bfloat16), int4_dequant(g.codes, g.scale, g.zero))
    assert torch.equal(f32, f32.to(torch.bfloat16).float())     # bfloat16 values
    xp = torch.randn(AVX2_GEMV_MAX_ROWS + 1, 576, generator=torch.Generator().manual_seed(8))
    assert torch.equal(lin.mm(xp), xp.to(torch.bfloat16).float() @ f32.T)


@needs_simd8
@pytest.mark.parametrize("n,k", [(4099, 576), (7, 100)])   # tails of rows and of 16 lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_equals_the_dequantized_product_and_rows_stand_alone(n, k, dtype):
    g = torch.Generator().manual_seed(5)
    lin = Int8Weight((torch.randn(n, k, generator=g) * 0.05).to(dtype))
    assert lin.gemv
    x = torch.randn(INT8_GEMV_MAX_ROWS + 3, k, generator=g).to(dtype)
    got = int8_gemv(x, lin.q, lin.scale)
    ref = x.to(torch.bfloat16).float() @ (lin.q.float() * lin.scale.float()[:, None]).T
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    for m in range(len(x)):
        assert torch.equal(int8_gemv(x[m:m + 1], lin.q, lin.scale)[0], got[m]), m
    assert torch.equal(lin.mm(x[:INT8_GEMV_MAX_ROWS]), got[:INT8_GEMV_MAX_ROWS])
    if not lin.batch:   # AVX2: no int8_gemm, int8_gemv at every row count
        assert torch.equal(lin.mm(x), got)


@needs_simd
def test_the_batch_helper_is_on_wherever_int4_gemv_runs_and_changes_no_bit():
    """decode's batch_helper (pdmesh up's default) turns the helper thread on wherever
    int4_gemv runs, AVX2 included: before, set_batch_helper did nothing where int4_gemm is
    not built, so on AVX2 int4_gemv's spans never reached the second core. On two threads
    the spans of weight rows give the bits of one."""
    from kernels.cpu_ops.gemv import batch_helper_on, set_batch_helper

    codes, s, z = weight(3075, 576, 12)       # 49 spans of 64 rows, the last of 3
    x = torch.randn(AVX2_GEMV_MAX_ROWS, 576, generator=torch.Generator().manual_seed(13))
    rows = (1, 2, 3, 4, GEMV_MAX_ROWS) + (() if batch_ready() else (AVX2_GEMV_MAX_ROWS,))
    one = [int4_gemv(x[:m], codes, s, z) for m in rows]
    set_batch_helper(True)
    try:
        assert batch_helper_on()
        for _ in range(3):
            for m, want in zip(rows, one):
                assert torch.equal(int4_gemv(x[:m], codes, s, z), want), m
    finally:
        set_batch_helper(False)
    assert not batch_helper_on()
