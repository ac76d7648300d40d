"""Sliding-window and soft-capped attention (shared/engine/masked_attention.py): decode
rows batched over their block tables equal each row alone, and a row alone equals plain
causal attention over exactly the keys its window holds."""
from __future__ import annotations

import pytest
import torch

from shared.engine.masked_attention import attend_decode, attend_rows, table_slots


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 2.0), (7, 1.5)])
def test_batched_decode_rows_equal_each_row_alone(window, softcap):
    g = torch.Generator().manual_seed(window)
    BS, NB, Hkv, G, D = 4, 32, 2, 3, 16
    kf = torch.randn(NB * BS, Hkv, D, generator=g)
    vf = torch.randn(NB * BS, Hkv, D, generator=g)
    ctx = torch.tensor([1, 3, 9, 17, 4], dtype=torch.int32)        # shorter and longer than
    tables = torch.stack([torch.randperm(NB, generator=g)[:6] for _ in ctx]).int()  # windows
    q = torch.randn(len(ctx), Hkv * G, D, generator=g)
    got = attend_decode(q, kf, vf, tables, ctx, BS, 0.25, window, softcap)
    for b, c in enumerate(ctx.tolist()):
        alone = attend_rows(q[b:b + 1], kf, vf, table_slots(tables[b], c, BS), c, 0.25,
                            window, softcap)
        torch.testing.assert_close(got[b:b + 1], alone, rtol=1e-5, atol=1e-6)


def test_a_row_sees_exactly_its_window():
    g = torch.Generator().manual_seed(0)
    kf, vf = torch.randn(20, 1, 8, generator=g), torch.randn(20, 1, 8, generator=g)
    q = torch.randn(1, 2, 8, generator=g)
    slots = torch.arange(20)
    got = attend_rows(q, kf, vf, slots, 12, 0.5, window=4)     # position 11 sees 8..11
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kf[8:12].transpose(0, 1).unsqueeze(0),
        vf[8:12].transpose(0, 1).unsqueeze(0), scale=0.5, enable_gqa=True)
    torch.testing.assert_close(got, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
