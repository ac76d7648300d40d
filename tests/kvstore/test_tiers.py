"""Tiered KV cache storage core: L2 memory LRU, L3 disk files, the store over both.

Real files under tmp_path; disk usage is measured with os.walk, never taken from the tier.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from services.kvstore.tiers import (
    BlockData,
    DiskTier,
    MemoryTier,
    TieredStore,
    file_size,
    layer_checksum,
)

LAYERS, LAYER_BYTES = 3, 256
BLOCK = LAYERS * LAYER_BYTES          # nbytes of every test block


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int) -> BlockData:
    rng = random.Random(i)
    return BlockData.build(rng.randbytes(LAYER_BYTES) for _ in range(LAYERS))


FILE = file_size(block(0))            # on-disk size of every test block


def disk_files(root: Path) -> list[Path]:
    return [Path(d, f) for d, _, fs in os.walk(root) for f in fs]


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in disk_files(root))


def block_path(root: Path, k: bytes) -> Path:
    return root / k.hex()[:2] / k.hex()


# ---- BlockData ---------------------------------------------------------------------------

def test_block_checksums_are_crc32_per_layer_and_verify_catches_a_bad_one():
    b = block(1)
    assert b.nbytes == BLOCK
    assert b.checksums == tuple(layer_checksum(l) for l in b.layers)
    assert b.verify()
    assert not BlockData(b.layers, (b.checksums[0] ^ 1,) + b.checksums[1:]).verify()
    with pytest.raises(ValueError):
        BlockData(b.layers, b.checksums[:1])


# ---- L2 ----------------------------------------------------------------------------------

def test_memory_tier_evicts_least_recently_used_first_within_budget():
    l2 = MemoryTier(3 * BLOCK)
    for i in range(3):
        assert l2.put(key(i), block(i)) == []
    assert l2.get(key(0)) == block(0)                # 1 is now the LRU
    assert l2.put(key(3), block(3)) == [(key(1), block(1))]
    assert l2.put(key(4), block(4)) == [(key(2), block(2))]
    assert [l2.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
    assert (len(l2), l2.bytes_used, l2.evictions) == (3, 3 * BLOCK, 2)
    assert l2.bytes_used <= l2.budget_bytes
    assert l2.pop(key(0)) == block(0) and l2.pop(key(0)) is None
    assert l2.bytes_used == 2 * BLOCK


def test_memory_tier_hands_back_an_entry_larger_than_its_budget_and_a_disabled_tier_all():
    for budget in (BLOCK - 1, 0):
        l2 = MemoryTier(budget)
        assert l2.put(key(1), block(1)) == [(key(1), block(1))]
        assert (len(l2), l2.bytes_used, l2.evictions) == (0, 0, 0)


# ---- L3 ----------------------------------------------------------------------------------

def test_disk_tier_keeps_files_within_budget_evicting_lru_first(tmp_path):
    l3 = DiskTier(tmp_path, 3 * FILE)
    for i in range(3):
        l3.put(key(i), block(i))
    assert disk_bytes(tmp_path) == l3.bytes_used == 3 * FILE
    assert l3.get(key(0)) == block(0)                # 1 is now the LRU
    l3.put(key(3), block(3))
    l3.put(key(4), block(4))
    assert [l3.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
    assert not block_path(tmp_path, key(1)).exists()
    assert disk_bytes(tmp_path) == l3.bytes_used <= l3.budget_bytes
    assert (len(l3), l3.evictions) == (3, 2)
    assert all(l3.get(key(i)) == block(i) for i in (0, 3, 4))
    assert not any(p.name.endswith(".tmp") for p in disk_files(tmp_path))
    assert l3.pop(key(0)) and not l3.pop(key(0))
    assert disk_bytes(tmp_path) == l3.bytes_used == 2 * FILE


def test_disk_tier_never_exceeds_budget_under_a_stream_of_puts(tmp_path):
    budget = 5 * FILE + FILE // 2
    l3 = DiskTier(tmp_path, budget)
    for i in range(40):
        l3.put(key(i), block(i))
        assert disk_bytes(tmp_path) == l3.bytes_used <= budget
    assert len(l3) == 5 and l3.evictions == 35


def flip_middle(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    mid = len(raw) - BLOCK // 2                      # inside the layers, past the header
    raw[mid:mid + 4] = bytes(b ^ 0xFF for b in raw[mid:mid + 4])
    p.write_bytes(bytes(raw))


def truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size - 100)


def garble_header(p: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes(b"XXXX" + raw[4:])


def empty(p: Path) -> None:
    p.write_bytes(b"")


@pytest.mark.parametrize("damage", [flip_middle, truncate, garble_header, empty])
def test_disk_tier_deletes_and_counts_a_corrupt_file(tmp_path, damage):
    l3 = DiskTier(tmp_path, 10 * FILE)
    l3.put(key(1), block(1))
    l3.put(key(2), block(2))
    damage(block_path(tmp_path, key(1)))
    assert l3.get(key(1)) is None
    assert l3.checksum_failures == 1
    assert not l3.contains(key(1)) and not block_path(tmp_path, key(1)).exists()
    assert l3.get(key(2)) == block(2)
    assert disk_bytes(tmp_path) == l3.bytes_used == FILE


def test_disk_tier_restart_keeps_entries_in_lru_order_and_removes_tmp_leftovers(tmp_path):
    l3 = DiskTier(tmp_path, 3 * FILE)
    for i in range(3):
        l3.put(key(i), block(i))
    l3.get(key(0))                                   # 1 is now the LRU, and stays so
    leftovers = [block_path(tmp_path, key(9)).with_name("dead.tmp"), tmp_path / "x.tmp"]
    leftovers[0].parent.mkdir(exist_ok=True)
    for p in leftovers:
        p.write_bytes(b"half a block")

    again = DiskTier(tmp_path, 3 * FILE)
    assert not any(p.exists() for p in leftovers)
    assert (len(again), again.bytes_used) == (3, disk_bytes(tmp_path))
    assert all(again.get(key(i)) == block(i) for i in (2, 0))  # 1 stays the LRU
    again.put(key(3), block(3))
    assert not again.contains(key(1)) and again.contains(key(0))
    assert disk_bytes(tmp_path) == again.bytes_used == 3 * FILE


def test_disk_tier_restart_with_a_smaller_budget_evicts_down_to_it(tmp_path):
    l3 = DiskTier(tmp_path, 4 * FILE)
    for i in range(4):
        l3.put(key(i), block(i))
    again = DiskTier(tmp_path, 2 * FILE)
    assert [again.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert disk_bytes(tmp_path) == again.bytes_used == 2 * FILE


def test_disk_tier_skips_oversize_blocks_and_stores_nothing_when_disabled(tmp_path):
    small = DiskTier(tmp_path / "small", FILE - 1)
    small.put(key(1), block(1))
    assert len(small) == 0 and disk_bytes(tmp_path / "small") == 0
    off = DiskTier(tmp_path / "off", 0)
    off.put(key(1), block(1))
    assert len(off) == 0 and off.get(key(1)) is None
    assert not (tmp_path / "off").exists()


# ---- TieredStore -------------------------------------------------------------------------

def store(tmp_path, l2_blocks=2, l3_blocks=10, **kw) -> TieredStore:
    return TieredStore(MemoryTier(l2_blocks * BLOCK), DiskTier(tmp_path, l3_blocks * FILE), **kw)


def test_l2_evictions_are_demoted_to_l3(tmp_path):
    s = store(tmp_path)
    for i in range(4):
        s.put(key(i), block(i))
    assert [s.l2.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert [s.l3.contains(key(i)) for i in range(4)] == [True, True, False, False]
    st = s.stats()
    assert (st["l2_entries"], st["l2_bytes"], st["l2_evictions"]) == (2, 2 * BLOCK, 2)
    assert (st["l3_entries"], st["l3_bytes"]) == (2, disk_bytes(tmp_path))


def test_l3_hit_is_promoted_to_l2_and_what_l2_evicts_is_demoted(tmp_path):
    s = store(tmp_path)
    for i in range(4):
        s.put(key(i), block(i))                      # L2: 2 3, L3: 0 1
    assert s.get(key(0)) == block(0)                 # from L3, into L2; 2 goes down
    assert s.l2.contains(key(0)) and s.l3.contains(key(0))
    assert not s.l2.contains(key(2)) and s.l3.contains(key(2))
    assert s.get(key(0)) == block(0)                 # now an L2 hit
    assert s.get(key(7)) is None
    st = s.stats()
    assert (st["lookups"], st["l2_hits"], st["l3_hits"], st["misses"]) == (3, 1, 1, 1)
    assert st["l2_hit_rate"] == st["l3_hit_rate"] == pytest.approx(1 / 3)


def test_write_through_puts_every_block_on_disk_at_once(tmp_path):
    s = store(tmp_path, write_through_l3=True)
    s.put(key(1), block(1))
    assert s.l2.contains(key(1)) and s.l3.contains(key(1))
    assert disk_bytes(tmp_path) == FILE


def test_disabled_l2_sends_blocks_straight_to_l3(tmp_path):
    s = store(tmp_path, l2_blocks=0)
    s.put(key(1), block(1))
    assert len(s.l2) == 0 and s.l3.contains(key(1))
    assert s.get(key(1)) == block(1) and len(s.l2) == 0
    assert s.stats()["l3_hits"] == 1


@pytest.mark.parametrize("l3", ["none", "zero budget"])
def test_without_l3_evicted_blocks_are_dropped(tmp_path, l3):
    disk = None if l3 == "none" else DiskTier(tmp_path / "l3", 0)
    s = TieredStore(MemoryTier(BLOCK), disk)
    s.put(key(1), block(1))
    s.put(key(2), block(2))
    assert s.get(key(1)) is None and s.get(key(2)) == block(2)
    assert s.longest_prefix([key(2)]) == 1
    st = s.stats()
    assert (st["l3_entries"], st["l3_bytes"], st["l3_budget_bytes"]) == (0, 0, 0)
    assert disk_bytes(tmp_path) == 0


def test_longest_prefix_counts_blocks_in_either_tier_up_to_the_first_gap(tmp_path):
    s = store(tmp_path)
    for i in range(4):
        s.put(key(i), block(i))                      # L2: 2 3, L3: 0 1
    keys = [key(i) for i in (0, 1, 2, 3, 5, 0)]
    assert s.longest_prefix(keys) == 4
    assert s.longest_prefix([key(5)] + keys) == 0
    assert s.longest_prefix([]) == 0
    assert s.stats()["lookups"] == 0                 # index only: no gets, no file reads


def test_corrupt_l3_block_shortens_fetch_prefix(tmp_path):
    s = store(tmp_path)
    for i in range(4):
        s.put(key(i), block(i))                      # L2: 2 3, L3: 0 1
    flip_middle(block_path(tmp_path, key(1)))
    keys = [key(i) for i in range(4)]
    assert s.longest_prefix(keys) == 4               # the index cannot know yet
    assert s.fetch_prefix(keys) == [block(0)]
    st = s.stats()
    assert (st["checksum_failures"], st["misses"], st["l3_hits"]) == (1, 1, 1)
    assert not block_path(tmp_path, key(1)).exists()
    assert s.longest_prefix(keys) == 1
    assert st["l3_bytes"] == disk_bytes(tmp_path)
