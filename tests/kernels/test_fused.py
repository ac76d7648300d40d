"""RMSNorm and RoPE in one C++ call each (kernels/cpu_ops/fused.cpp), against the torch
expressions Model.rms_norm and Model.rope run without them: RoPE gives the same bits,
RMSNorm agrees within a float32 rounding of its sum (then one rounding to bfloat16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="C++ CPU ops not built")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def norm_ref(x, w, eps, gemma):
    xf = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (xf * w).to(x.dtype) if gemma else w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("T,H", [(1, 576), (7, 100)])
def test_rms_norm_agrees_with_the_torch_path(dtype, gemma, T, H):
    x = (torch.randn(T, H, generator=gen(T * H)) * 3).to(dtype)
    w = torch.randn(H, generator=gen(1)).to(dtype)
    w = 1.0 + w.float() if gemma else w                  # Model._norm_weight
    got, ref = cpu_ops.rms_norm(x, w, 1e-5, gemma), norm_ref(x, w, 1e-5, gemma)
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:      # a last-bit difference before rounding moves at most one bfloat16 step
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
        assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gives_the_torch_expressions_bits_on_a_strided_view(dtype, interleaved):
    T, heads, D = 5, 12, 64
    qkv = torch.randn(T, (heads + 3) * D, generator=gen(2)).to(dtype)
    x = qkv[:, :heads * D].view(T, heads, D)             # as Model.forward slices q|k
    cos = torch.randn(T, 1, D, generator=gen(3)).to(dtype)
    sin = torch.randn(T, 1, D, generator=gen(4)).to(dtype)
    if interleaved:
        ref = x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin
    else:
        ref = x * cos + torch.roll(x, D // 2, dims=-1) * sin
    assert torch.equal(cpu_ops.rope(x, cos, sin, interleaved), ref)


def test_shapes_it_does_not_take_fall_back_to_torch():
    x = torch.randn(2, 3, 8)
    assert cpu_ops.rms_norm(x, torch.ones(8), 1e-5, False) is None          # 3-D
    assert cpu_ops.rms_norm(x[0].T, torch.ones(3), 1e-5, False) is None      # strided
    assert cpu_ops.rms_norm(x[0].half(), torch.ones(8).half(), 1e-5, False) is None
    assert cpu_ops.rope(x, torch.ones(1, 1, 8), torch.ones(1, 1, 8), False) is None  # T 1 != 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_agrees_with_the_torch_path(dtype):
    gu = (torch.randn(3, 2 * 1536, generator=gen(5)) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref, got = F.silu(gate) * up, cpu_ops.silu_mul(gu)
    assert got.dtype == dtype and got.shape == ref.shape
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:     # exp's last float32 bit (std::exp, SLEEF) can move one bfloat16 step
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
        assert (got == ref).float().mean() > 0.99
