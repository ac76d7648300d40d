"""TEST ONLY fault injection (services/decode/faults.py): each KV fault changes exactly the
selected blocks, repeatably; selection by seed is deterministic; the repeat loop is a
logit bias that keeps the request's other params."""
from __future__ import annotations

import pytest
import torch

from services.decode import faults
from shared.contracts.sampling import SamplingParams


def pool(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 2, 10, 4, 2, 8, generator=g)    # [L, 2, blocks, bs, Hkv, D]


def untouched(before: torch.Tensor, after: torch.Tensor, blocks: list[int]) -> bool:
    rest = [b for b in range(before.shape[2]) if b not in blocks]
    return torch.equal(before[:, :, rest], after[:, :, rest])


def test_zero_layer_zeroes_one_middle_layer_of_the_blocks_only():
    kv = pool()
    before = kv.clone()
    faults.corrupt("zero_layer", kv, [2, 5], seed=1)
    assert torch.count_nonzero(kv[3, :, [2, 5]]) == 0
    assert torch.equal(kv[[0, 1, 2, 4, 5]], before[[0, 1, 2, 4, 5]])
    assert untouched(before, kv, [2, 5])


def test_swap_copies_other_blocks_in_and_leaves_them_as_they_were():
    kv = pool()
    before = kv.clone()
    faults.corrupt("swap", kv, [1, 2], seed=3, others=[7, 8])
    got = {tuple(kv[0, 0, b, 0, 0, :2].tolist()) for b in (1, 2)}
    assert got == {tuple(before[0, 0, b, 0, 0, :2].tolist()) for b in (7, 8)}
    assert untouched(before, kv, [1, 2])                   # the other request's blocks too
    kv2 = pool()
    faults.corrupt("swap", kv2, [1, 2, 3], seed=3, others=[9])   # fewer: with replacement
    assert all(torch.equal(kv2[:, :, b], before[:, :, 9]) for b in (1, 2, 3))
    kv3 = pool()
    faults.corrupt("swap", kv3, [0], seed=4)               # no live request: the pool
    assert not torch.equal(kv3[:, :, 0], before[:, :, 0])


def test_noise_is_scaled_to_the_blocks_std_and_repeatable():
    a, b = pool(), pool()
    before = a.clone()
    faults.corrupt("noise", a, [4], seed=9, noise_scale=2.0)
    faults.corrupt("noise", b, [4], seed=9, noise_scale=2.0)
    assert torch.equal(a, b) and untouched(before, a, [4])
    diff = (a[:, :, 4] - before[:, :, 4]).std() / before[:, :, 4].std()
    assert 1.8 < float(diff) < 2.2


def test_selection_by_seed_and_kinds():
    kinds = faults.parse_kinds("zero_layer, noise") + (faults.REPEAT_LOOP,)
    assert kinds == ("zero_layer", "noise", "repeat_loop")
    assert [faults.select(s, 100, kinds) for s in (0, 100, 200, 300, 150, None)] == \
        ["zero_layer", "noise", "repeat_loop", "zero_layer", None, None]
    assert faults.select(0, 0, kinds) is None and faults.select(0, 100, ()) is None
    with pytest.raises(ValueError, match="unknown KV fault"):
        faults.parse_kinds("zero_layer,bitflip")
    with pytest.raises(ValueError):
        faults.corrupt("repeat_loop", pool(), [0], seed=0)


def test_repeat_loop_biases_one_token_and_keeps_the_rest():
    p = SamplingParams(temperature=0.7, seed=5, max_tokens=99, logit_bias={3: -1.0})
    q = faults.repeat_loop(p, 42)
    assert q.logit_bias == {3: -1.0, 42: faults.REPEAT_BIAS}
    assert (q.temperature, q.seed, q.max_tokens) == (0.7, 5, 99)
    q.check(vocab_size=100)
