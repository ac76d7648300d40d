"""The C++ CPU ops (kernels/cpu_ops/ops.cpp) give the torch reference's bits: the W8A8 ops'
codes, row scales and the scaled-back GEMM result, on odd shapes, in every dtype, with and
without SmoothQuant's factor, on rows with ties, zeros and outliers; and the decode attention
read in place, close to the torch path."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops import dequant_rows_ref, load, quant_rows_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the C++ CPU ops did not build (make venv builds them; see the log)")
    return mod


def rows(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    x[0, :3] = torch.tensor([127.0, -63.5, 0.5])      # exact ties after the scaling
    if M > 2:
        x[1] = 0.0                                      # an all-zero row: scale 1e-8 / 127
        x[2, K // 2] = 300.0                            # one outlier channel
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(1, 7), (6, 576), (17, 1536), (33, 100)])
@pytest.mark.parametrize("smooth", [False, True])
def test_quant_rows_gives_the_reference_bits(ext, dtype, M, K, smooth):
    x = rows(M, K, dtype, seed=M * K)
    inv = None
    if smooth:   # powers of two, as smoothing() makes them
        e = torch.randint(-4, 5, (K,), generator=torch.Generator().manual_seed(K))
        inv = torch.exp2(e.float()).to(torch.bfloat16 if dtype == torch.float32 else dtype)
    q, sx = ext.quant_rows(x, inv)
    rq, rsx = quant_rows_ref(x, inv)
    assert q.dtype == torch.int8 and sx.dtype == torch.float32 and sx.shape == (M, 1)
    assert torch.equal(q, rq)
    assert torch.equal(sx, rsx)
    u, usx = ext.quant_rows(x, inv, u8=True)         # oneDNN's u8 activations: code + 128
    assert u.dtype == torch.uint8 and torch.equal(usx, rsx)
    assert torch.equal(u.to(torch.int16) - 128, rq.to(torch.int16))
    assert torch.equal(u, quant_rows_ref(x, inv, u8=True)[0])


def test_quant_rows_takes_a_strided_input(ext):
    x = rows(8, 64, torch.bfloat16, 1).T.contiguous().T      # column-major view
    q, sx = ext.quant_rows(x, None)
    rq, rsx = quant_rows_ref(x)
    assert torch.equal(q, rq) and torch.equal(sx, rsx)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 5), (6, 832), (16, 3072), (31, 49)])
@pytest.mark.parametrize("float_acc", [False, True])
def test_dequant_rows_gives_the_reference_bits(ext, dtype, M, N, float_acc):
    g = torch.Generator().manual_seed(M + N)
    acc = torch.randint(-(1 << 26), 1 << 26, (M, N), generator=g, dtype=torch.int32)
    if float_acc:                                   # oneDNN's exact float32 of the sums
        acc = acc.float()
    sx = torch.rand(M, 1, generator=g) / 127
    sw = torch.rand(N, generator=g) / 127
    out = ext.dequant_rows(acc, sx, sw, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, dequant_rows_ref(acc, sx, sw, dtype))


@pytest.mark.parametrize("M", [6, 16, 100])
def test_the_prepacked_int8_gemm_gives_the_unpacked_bits(ext, M):
    """W8A8 through oneDNN's prepacked qlinear (what Int8Weight uses) equals torch._int_mm
    on the plain weight with the reference quantization, bit for bit. Where that GEMM
    saturates (AVX2 without VNNI: quant.qlinear_exact), torch._int_mm itself serves: before,
    the prepacked weight was used there too and these sums were off by thousands."""
    from shared.engine.quant import Int8Weight, qlinear_exact

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = rows(M, 64, torch.bfloat16, 4)
    lin = Int8Weight(w, a8=True)
    assert (lin.packed is not None) == qlinear_exact()
    xq, sx = quant_rows_ref(x)
    ref = dequant_rows_ref(torch._int_mm(xq, lin.q.T), sx, lin.scale_f, x.dtype)
    assert torch.equal(lin.mm(x), ref)
    # and it is a matmul: close to x @ w.T
    exact = x.float() @ w.float().T
    assert (lin.mm(x).float() - exact).norm() / exact.norm() < 0.02


def test_bad_shapes_are_refused(ext):
    with pytest.raises(RuntimeError, match="inv must be"):
        ext.quant_rows(torch.ones(2, 8), torch.ones(7))
    with pytest.raises(RuntimeError, match="acc int32 or float32"):
        ext.dequant_rows(torch.ones(2, 8, dtype=torch.int16), torch.ones(2, 1), torch.ones(8),
                         torch.float32)


# ---- decode attention read in place (close to the torch path, not its bits) --------------

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_case(B, Hq, Hkv, D, BS, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    NB = 64
    kc = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    mb = max(1, max(-(-n // BS) for n in lens) + 1)        # a spare column: -1 padding
    bt = torch.full((B, mb), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        nb = -(-n // BS)
        bt[b, :nb] = torch.randperm(NB, generator=g)[:nb].to(torch.int32)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,D,BS,lens", [
    (1, 9, 3, 64, 16, [100]), (3, 4, 4, 8, 4, [1, 4, 5]), (5, 6, 2, 20, 3, [0, 7, 2, 9, 31]),
    (16, 9, 3, 64, 16, [17 * i + 1 for i in range(16)]),
    # bfloat16's fast path: G = 8 at D = 128, G = 1 at D = 32, 16-position tails; G = 16
    # and D = 320 take the generic loops
    (4, 16, 2, 128, 16, [1, 15, 16, 33]), (2, 4, 4, 32, 8, [0, 40]), (1, 16, 1, 64, 16, [20]),
    (1, 2, 1, 320, 4, [9])])
def test_paged_decode_matches_the_torch_path(ext, dtype, B, Hq, Hkv, D, BS, lens):
    from kernels.paged_attention.ref import paged_attention_decode_ref

    q, kc, vc, bt, cl = paged_case(B, Hq, Hkv, D, BS, lens, dtype, seed=B + D)
    got = ext.paged_decode(q, kc, vc, bt, cl, D ** -0.5)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, D ** -0.5)
    assert got.dtype == dtype and got.shape == (B, Hq, D)
    assert torch.allclose(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[cl == 0], torch.zeros_like(got[cl == 0]))   # empty context: zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx", [1, 16, 37])
def test_one_row_over_slots_matches_sdpa(ext, dtype, ctx):
    g = torch.Generator().manual_seed(ctx)
    kf = torch.randn(80, 3, 64, generator=g).to(dtype)
    vf = torch.randn(80, 3, 64, generator=g).to(dtype)
    q = torch.randn(9, 64, generator=g).to(dtype)
    slots = torch.randperm(80, generator=g)[:ctx]
    got = ext.slots_decode(q, kf, vf, slots, 0.125)
    ks, vs = kf[slots].float().transpose(0, 1), vf[slots].float().transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, None].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), scale=0.125,
        enable_gqa=True)[0, :, 0]
    assert torch.allclose(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_refuses_what_it_cannot_read(ext):
    q, kc, vc, bt, cl = paged_case(2, 4, 2, 8, 4, [3, 5], torch.float32)
    with pytest.raises(RuntimeError, match="block out of range"):
        ext.paged_decode(q, kc, vc, torch.full_like(bt, 64), cl, 1.0)
    with pytest.raises(RuntimeError, match="context too long"):
        ext.paged_decode(q, kc, vc, bt, torch.tensor([3, 500], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="head shapes"):
        ext.paged_decode(torch.ones(2, 3, 8), kc, vc, bt, cl, 1.0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ext.slots_decode(q[0], kc.view(-1, 2, 8), vc.view(-1, 2, 8), torch.tensor([0, 999]), 1.0)
