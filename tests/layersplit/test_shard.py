"""The pure core of a rank's share of the LayerSplit store: ownership, slots partitioned by
origin, LRU eviction in one's own partition, inserts replacing a slot's key everywhere,
key-checked reads, losing every entry."""
from __future__ import annotations

import pytest
import torch

from services.prefill.layersplit.shard import ShardStore, owned_layers, owner

SHAPE = (4, 2, 8)          # block_size, Hkv, D
LAYER_BLOCK = 2 * 4 * 2 * 8 * 4


def store(rank: int = 0, size: int = 2, slots: int = 4) -> ShardStore:
    most = -(-6 // size)
    return ShardStore(size, rank, 6, SHAPE, torch.float32, slots * most * LAYER_BLOCK)


def data(st: ShardStore, n: int, v: float) -> torch.Tensor:
    return torch.full((len(st.owned), 2, n, *SHAPE), v)


def test_round_robin_ownership_and_sizes():
    assert owned_layers(6, 2, 0) == [0, 2, 4] and owned_layers(6, 2, 1) == [1, 3, 5]
    assert [owner(layer, 3) for layer in range(6)] == [0, 1, 2, 0, 1, 2]
    one, two = store(size=1, slots=4), store(size=2, slots=8)
    assert one.kv.untyped_storage().nbytes() == two.kv.untyped_storage().nbytes()
    assert two.num_slots == 2 * one.num_slots          # same bytes, twice the blocks
    with pytest.raises(ValueError):
        ShardStore(2, 0, 6, SHAPE, torch.float32, 10)


def test_slots_partitioned_by_origin_and_lru_within():
    a, b = store(0), store(1)
    sa, sb = a.allocate(2), b.allocate(2)
    assert set(sa).isdisjoint(sb) and all(s < 2 for s in sa) and all(s >= 2 for s in sb)
    keys = [b"k0" * 8, b"k1" * 8]
    a.put(sa, keys, data(a, 2, 1.0))
    b.put(sa, keys, data(b, 2, 1.0))           # the insert reaches rank 1
    assert a.match(keys + [b"x" * 16]) == sa and b.match(keys) == sa
    a.gather(0, sa[:1], keys[:1])               # touch k0: k1 is now least recently used
    (s,) = a.allocate(1)
    assert s == sa[1] and a.match(keys) == sa[:1] and a.counters["group_evictions"] == 1
    new = [b"k2" * 8]
    a.put([s], new, data(a, 1, 2.0))
    b.put([s], new, data(b, 1, 2.0))            # the same insert evicts k1 on rank 1 too
    assert b.match(keys) == sa[:1] and b.match(new) == [s]


def test_reads_check_the_key_and_losing_drops_everything():
    a = store(0)
    slots = a.allocate(2)
    keys = [b"a" * 16, b"b" * 16]
    a.put(slots, keys, data(a, 2, 3.0))
    got = a.gather(2, slots, keys)
    assert got.shape == (2, 2, *SHAPE) and float(got.mean()) == 3.0
    assert a.gather(2, slots, [keys[0], b"z" * 16]) is None      # slot reused meanwhile
    assert a.counters["group_stale_reads"] == 1
    assert a.stats()["group_cached_bytes"] == 2 * 3 * LAYER_BLOCK
    assert a.clear() == 2 and a.match(keys) == [] and a.stats()["group_cached_blocks"] == 0
    assert len(a.allocate(10)) == a.num_slots // 2                # my whole partition again
