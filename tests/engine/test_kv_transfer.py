"""KV transfer packing: every piece fits the payload limit, and pack -> unpack moves
exactly the right blocks and layers into another pool."""
from __future__ import annotations

import pytest
import torch

from shared.engine.kv_transfer import pack, plan, unpack_into


def pool(L=5, NB=12, BS=4, H=2, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)


@pytest.mark.parametrize("max_bytes", [10_000, 3_000, 600, 520])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_pack_unpack_roundtrip(max_bytes, dtype):
    src, dst = pool(dtype=dtype), torch.zeros(5, 2, 12, 4, 2, 8, dtype=dtype)
    src_blocks, dst_blocks = [7, 2, 9, 0, 5], [1, 11, 3, 4, 8]
    pieces = plan(len(src_blocks), src, max_bytes)
    covered = set()
    for p in pieces:
        payload, shape = pack(src, src_blocks[p.b0:p.b1], p.l0, p.l1)
        assert len(payload) <= max_bytes
        unpack_into(dst, dst_blocks[p.b0:p.b1], p.l0, p.l1, payload,
                    {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], shape)
        covered |= {(b, l) for b in range(p.b0, p.b1) for l in range(p.l0, p.l1)}
    assert covered == {(b, l) for b in range(5) for l in range(5)}
    assert torch.equal(dst[:, :, dst_blocks], src[:, :, src_blocks])
    untouched = [b for b in range(12) if b not in dst_blocks]
    assert dst[:, :, untouched].abs().sum() == 0


def test_payload_that_does_not_fit_the_pool_is_refused():
    src, dst = pool(), pool(D=4)
    payload, shape = pack(src, [0], 0, 5)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_into(dst, [0], 0, 5, payload, "float32", shape)


def test_block_layer_larger_than_payload_is_refused():
    with pytest.raises(ValueError, match="max payload"):
        plan(3, pool(), 100)
