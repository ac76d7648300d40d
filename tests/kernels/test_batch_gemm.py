"""The matmuls of a decode batch's rows (kernels/cpu_ops/batch_gemm.cpp): the int4 weight
decoded to int4_dequant's own values, the int8 weight exactly, their sums against torch,
and each row's result independent of the batch it is in (the rows around it, how many,
where it sits): a sequence's tokens do not depend on who else is decoding."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops.gemv import (
    GEMM_MAX_ROWS,
    GEMV_MAX_ROWS,
    INT8_GEMV_MAX_ROWS,
    batch_ready,
    gemv_pack,
    int4_dequant,
    int4_gemm,
    int4_gemv,
    int4_gemv_ref,
    int8_gemm,
)
from shared.engine.quant import Int4Weight, Int8Weight, int4_codes

pytestmark = pytest.mark.skipif(not batch_ready(), reason="C++ ops without AVX512-BF16 here")
SHAPES = [(960, 576), (577, 1536), (6, 64)]   # SmolLM2's qkv and down; tails of weight rows


def weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s, z = int4_codes(torch.randn(n, k, generator=g) * 0.05)
    return gemv_pack(q), s[..., 0].to(torch.bfloat16).contiguous(), z[..., 0].to(torch.bfloat16).contiguous()


def rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_int4_gemm_multiplies_by_exactly_the_dequantized_weight():
    """One-hot rows pick single weights out, bit for bit: the kernel's decoded weight is
    int4_dequant's (the weight prefill's GEMM uses)."""
    codes, s, z = weight(37, 128)
    eye = torch.eye(128, dtype=torch.bfloat16)
    assert torch.equal(int4_gemm(eye, codes, s, z), int4_dequant(codes, s, z).T)


def test_int8_gemm_multiplies_by_exactly_q_times_scale():
    lin = Int8Weight(rows(41, 96, 1) * 0.05)
    eye = torch.eye(96)
    assert torch.equal(int8_gemm(eye, lin.q, lin.scale), (lin.q.float() * lin.scale.float()[:, None]).T)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [GEMV_MAX_ROWS + 1, 16, GEMM_MAX_ROWS + 3])
def test_int4_gemm_equals_the_reference(n, k, dtype, m):
    codes, s, z = weight(n, k)
    x = rows(m, k, 2, dtype)
    got, ref = int4_gemm(x, codes, s, z), int4_gemv_ref(x, codes, s, z)
    assert got.dtype == dtype and got.shape == (m, n)
    # the weight rounded to bfloat16 (the reference keeps it in float32), sums in another
    # order; one bfloat16 step where the output is bfloat16
    tol = 1e-2
    assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("n,k", [(4099, 576), (7, 96)])   # tails of weight rows and of 64
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_equals_the_dequantized_product(n, k, dtype):
    lin = Int8Weight((rows(n, k, 5) * 0.05).to(dtype))
    x = rows(13, k, 6, dtype)
    got = int8_gemm(x, lin.q, lin.scale)
    ref = x.to(torch.bfloat16).float() @ (lin.q.float() * lin.scale.float()[:, None]).T
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_a_rows_int4_result_does_not_depend_on_its_batch(n, k):
    """Bit for bit: row m alone, or among 2..20 rows, at any position, or past a 64-row
    pass over the weight."""
    codes, s, z = weight(n, k)
    x = rows(70, k, 3)
    alone = torch.cat([int4_gemm(x[m:m + 1], codes, s, z) for m in range(len(x))])
    for m in range(2, 21):
        assert torch.equal(int4_gemm(x[:m], codes, s, z), alone[:m]), m
    assert torch.equal(int4_gemm(x.flip(0), codes, s, z), alone.flip(0))


def test_a_rows_logits_do_not_depend_on_its_batch():
    """The LM head's rows (int8_gemm from INT8_GEMV_MAX_ROWS + 1 rows) stand alone."""
    lin = Int8Weight(rows(1031, 576, 7) * 0.05)
    x = rows(20, 576, 8)
    alone = torch.cat([int8_gemm(x[m:m + 1], lin.q, lin.scale) for m in range(len(x))])
    for m in range(INT8_GEMV_MAX_ROWS + 1, 21):
        assert torch.equal(lin.mm(x[:m]), alone[:m]), m
    assert torch.equal(lin.mm(x.flip(0)), alone.flip(0))


def test_int4_weight_takes_int4_gemm_for_a_decode_batch():
    lin = Int4Weight(rows(96, 576, 9) * 0.05)
    g = lin.gemv
    for m in (GEMV_MAX_ROWS + 1, GEMM_MAX_ROWS):
        x = rows(m, 576, m)
        assert torch.equal(lin.mm(x), int4_gemm(x, g.codes, g.scale, g.zero)), m


def test_the_helper_thread_changes_no_bit():
    """With the helper on (pdmesh up's decode), the work items run on two threads in an
    order the OS picks: each item's results are the same bits as on one thread."""
    from kernels.cpu_ops.gemv import set_batch_helper

    codes, s, z = weight(3075, 576)          # (a last span of 3 weight rows)
    head = Int8Weight(rows(4099, 576, 10) * 0.05)
    x = rows(70, 576, 11)

    def products():
        return [int4_gemm(x, codes, s, z), int8_gemm(x[:16], head.q, head.scale),
                *(int4_gemv(x[:m], codes, s, z) for m in (1, 2, GEMV_MAX_ROWS))]
    one = products()
    set_batch_helper(True)
    try:
        for _ in range(3):
            for a, b in zip(products(), one):
                assert torch.equal(a, b)
    finally:
        set_batch_helper(False)
