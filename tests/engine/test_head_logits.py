"""The LM head's logits are float32 where they decide: a bfloat16 model's head (and a
float32 model's on torch's int8 kernel, without AVX-512) rounded them to steps of 0.125 at
16-32, and the greedy token was chosen between rounded values, ties included. On an AVX2
machine the default model answered the README's question with "L'Étoile, la Marseillaise,
la femme au martyre..." ("The" 25.54 and "L" 25.35 both came out 25.375; the tie went to
"L"); tests/e2e/test_default_model.py asks it through the mesh."""
from __future__ import annotations

import pytest
import torch

from shared.engine.quant import Int8Weight, quantize_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_top_logits_are_its_int8_weight_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 64, generator=g).to(dtype)
    x = (torch.randn(5, 64, generator=g) * 4).to(dtype)          # logits of 10-40
    head = quantize_weight(w, "int4", head=True)
    got = head.mm(x)
    want = x.float() @ (head.q.float() * head.scale_f[:, None]).T
    assert got.dtype == torch.float32
    top = want.topk(8).indices          # (refined: the 16 largest of the rounded values)
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=0, atol=1e-3)
    assert torch.equal(got.argmax(1), want.argmax(1))
    if dtype == torch.bfloat16:          # the plain weight's own output: rounded
        plain = Int8Weight(w).mm(x).float()
        assert not torch.allclose(plain.gather(1, top), want.gather(1, top), rtol=0, atol=1e-3)


def test_a_row_gets_the_same_logits_whatever_the_batch():
    g = torch.Generator().manual_seed(1)
    head = Int8Weight(torch.randn(1000, 64, generator=g), head=True)
    x = torch.randn(9, 64, generator=g) * 4
    assert torch.equal(head.mm(x)[3:4], head.mm(x[3:4]))
