"""Weight-only quantization (shared/engine/quant.py): the packed matmuls equal the
dequantized weights' matmul, a Q4_1-grid weight survives int4 exactly, and a quantized
engine stays batch invariant and close to the unquantized one."""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.quant import Int4Weight, Int8Weight, int4_codes, quantize_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
def test_packed_matmul_equals_dequantized_matmul(kind, dtype, device):
    torch.manual_seed(0)
    w = (torch.randn(96, 128) * 0.05).to(dtype).to(device)
    qw = kind(w)
    x = torch.randn(5, 128).to(dtype).to(device)
    want = x.float() @ qw.dequantize().float().T
    got = qw.mm(x).float()
    assert got.shape == (5, 96)
    tol = 2e-2     # the CPU kernels take bfloat16 activations (a float32 model's too)
    assert torch.allclose(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    # and the dequantized weight is close to the original (per-channel / per-group grid)
    err = (qw.dequantize().float() - w.float()).abs().max().item()
    assert err < (0.05 if kind is Int4Weight else 0.005)


def test_int4_recovers_a_q4_1_grid_exactly(device):
    """llama.cpp's Q4_1 stores w = q * d + m per group of 32 (q in 0..15): a weight on
    that grid (min and max attained, as Q4_1 quantizes) gets its codes back exactly, and
    scale d and zero m + 8d; the packed weight holds them (bfloat16 scales)."""
    torch.manual_seed(1)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15                       # each group spans its whole range
    d = torch.rand(n, k // 32, 1) * 0.01 + 1e-3
    m = torch.randn(n, k // 32, 1) * 0.05
    w = (q * d + m).reshape(n, k)
    codes, scale, zero = (t.cpu() for t in int4_codes(w.to(device)))
    assert torch.equal(codes, q.reshape(n, k).to(torch.int32))
    assert torch.allclose(scale, d, rtol=1e-5) and torch.allclose(zero, m + 8 * d, atol=1e-6)
    got = Int4Weight(w.to(device)).dequantize().float().cpu()
    assert torch.allclose(got, w, atol=2e-3)


def test_lm_head_stays_int8_under_int4():
    w = torch.randn(64, 64)
    assert isinstance(quantize_weight(w, "int4", head=True), Int8Weight)
    assert isinstance(quantize_weight(w, "int4"), Int4Weight)
    assert quantize_weight(w, "") is w
    with pytest.raises(ValueError):
        quantize_weight(w, "int3")
    with pytest.raises(ValueError):
        EngineConfig(model="x", quantize="fp8")


@pytest.mark.parametrize("mode", ["int8", "int4", "int4+a8"])
def test_quantized_engine_is_batch_invariant_and_close(tiny_target, tiny_prompts, mode, device):
    """+a8: act_int8, batches on int8 activations (deterministic mode pads every forward to
    a fixed row count, so the same path runs whatever the batch)."""
    base = dict(model=str(tiny_target), num_blocks=256, deterministic=True, max_num_seqs=8,
                max_num_batched_tokens=64, chunk_size=32, device=device)
    q = LLMEngine(EngineConfig(**base, quantize=mode.removesuffix("+a8"),
                               act_int8=mode.endswith("+a8")))
    full = LLMEngine(EngineConfig(**base))
    assert q.model.weight_bytes < full.model.weight_bytes * (0.3 if mode == "int8" else 0.25)
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = tiny_prompts[:6]
    alone = [q.generate([x], p)[0]["token_ids"] for x in prompts]
    together = [r["token_ids"] for r in q.generate(prompts, p)]
    assert together == alone
    ref = [r["token_ids"] for r in full.generate(prompts, p)]
    first = sum(a[0] == b[0] for a, b in zip(alone, ref))
    assert first >= len(prompts) - 1, (alone, ref)   # the first greedy token rarely moves
