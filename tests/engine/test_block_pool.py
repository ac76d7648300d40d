"""Block pool bookkeeping: no leak over many random cycles, clear errors."""
from __future__ import annotations

import random

import pytest

from shared.engine.block_pool import BlockPool, NoFreeBlocks


def test_no_leak_after_1000_random_cycles():
    pool = BlockPool(64, 16)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(1000):
        if held and (rng.random() < 0.5 or not pool.can_allocate(1)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 8)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
            else:
                with pytest.raises(NoFreeBlocks):
                    pool.allocate(n)
        flat = [b for h in held for b in h]
        assert len(flat) == len(set(flat)) == pool.num_used
        assert pool.num_used + pool.num_free == 64
    for h in held:
        pool.free(h)
    assert pool.num_free == 64


def test_exhaustion_error_names_the_numbers():
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks, match="need 2 KV blocks, 1 of 4 free"):
        pool.allocate(2)


def test_double_free_is_refused():
    pool = BlockPool(4, 16)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(b)


def test_every_allocation_gets_a_new_epoch():
    pool = BlockPool(2, 16)
    a = pool.allocate(1)[0]
    e1 = pool.epoch[a]
    pool.free([a])
    pool.free(pool.allocate(2))
    assert pool.epoch[a] != e1


def test_epochs_are_drawn_not_counted():
    """An epoch seen in one job says nothing about another block's (issue 29: with one
    counter per pool, a writer that saw a job's epochs overwrote cached blocks by trying
    the neighbouring values)."""
    pool = BlockPool(64, 16)
    blocks = pool.allocate(64)
    seen = sorted(pool.epoch[b] for b in blocks)
    pool.restamp(blocks)
    seen += sorted(pool.epoch[b] for b in blocks)
    assert len(set(seen)) == 128 and all(e > 0 for e in seen)
    gaps = [abs(a - b) for a in seen for b in seen if a != b]
    assert min(gaps) > 1 << 20           # no neighbours: 63 random bits each
