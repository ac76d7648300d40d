"""One rank's share of a LayerSplit group's prefix store: the group's cached prefix blocks,
for the layers this rank owns only.

Ownership is round-robin, owner(l) = l mod N: a request's cached layers then alternate
between owners, so while layer l computes the next remote layer is already on its way (for
N = 2 every other layer is local and needs no transfer at all), and every rank serves an
equal share of each request's transfers. Contiguous ranges would make the first remote
range a burst that compute must wait for, and put the early-layer owner first in line for
every request.

Slots are the group's: slot s names the same cached block on every rank (each rank holds
its own layers of it), so a transfer request is a list of slots. The slot space is split
into N partitions, one per origin rank: only the origin allocates (and evicts, LRU) in its
own partition, so ranks never race for a slot. An insert names (slot, key) pairs; it
replaces whatever key the slot held before (that is how an eviction reaches the others).
Every read checks that the slot still holds the expected key, under the lock, so a slot
reused meanwhile is a miss (recompute), never another prefix's KV.

Pure bookkeeping plus one tensor [owned layers, 2, slots, block_size, Hkv, D]; no I/O.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

import torch


def owned_layers(num_layers: int, size: int, rank: int) -> list[int]:
    return [layer for layer in range(num_layers) if layer % size == rank]


def owner(layer: int, size: int) -> int:
    return layer % size


class ShardStore:
    def __init__(self, size: int, rank: int, num_layers: int, block_shape: tuple[int, int, int],
                 dtype: torch.dtype, budget_bytes: int):
        """block_shape: (block_size, Hkv, D). Every rank derives the same slot count from
        the same budget (the largest share of layers any rank owns)."""
        self.size, self.rank, self.num_layers = size, rank, num_layers
        self.owned = owned_layers(num_layers, size, rank)
        self.local = {layer: i for i, layer in enumerate(self.owned)}
        bs, hkv, d = block_shape
        self.layer_block_bytes = 2 * bs * hkv * d * torch.empty((), dtype=dtype).element_size()
        most = -(-num_layers // size)
        per_partition = int(budget_bytes) // (most * self.layer_block_bytes) // size
        if per_partition < 1:
            raise ValueError(f"group cache budget {budget_bytes} B holds no block "
                             f"({most} layers x {self.layer_block_bytes} B per slot)")
        self.num_slots = per_partition * size
        self.kv = torch.zeros(len(self.owned), 2, self.num_slots, bs, hkv, d, dtype=dtype)
        self.slot_key: list[bytes | None] = [None] * self.num_slots
        self.index: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()      # my partition's used slots
        lo = rank * per_partition
        self.free: deque[int] = deque(range(lo, lo + per_partition))
        self.lock = threading.Lock()
        self.counters = {"group_inserted_blocks": 0, "group_evictions": 0,
                         "group_lookup_blocks": 0, "group_hit_blocks": 0,
                         "group_stale_reads": 0, "group_lost_blocks": 0}

    def _mine(self, slot: int) -> bool:
        return slot // (self.num_slots // self.size) == self.rank

    # ---- index --------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> list[int]:
        """Slots of the longest leading run of keys the group holds (as this rank knows)."""
        out = []
        with self.lock:
            for k in keys:
                s = self.index.get(k)
                if s is None:
                    break
                out.append(s)
            self.counters["group_lookup_blocks"] += len(keys)
            self.counters["group_hit_blocks"] += len(out)
        return out

    def missing(self, keys: list[bytes]) -> list[int]:
        """Positions of keys the group does not hold (what an insert should add)."""
        with self.lock:
            return [i for i, k in enumerate(keys) if k not in self.index]

    def allocate(self, n: int) -> list[int]:
        """Up to n slots of my partition (free first, then least recently used)."""
        out = []
        with self.lock:
            while len(out) < n and (self.free or self.lru):
                if self.free:
                    s = self.free.popleft()
                else:
                    s, _ = self.lru.popitem(last=False)
                    self.counters["group_evictions"] += 1
                self._drop(s)
                out.append(s)
        return out

    def _drop(self, slot: int) -> None:
        k = self.slot_key[slot]
        if k is not None and self.index.get(k) == slot:
            del self.index[k]
        self.slot_key[slot] = None

    def put(self, slots: list[int], keys: list[bytes], data: torch.Tensor | None) -> None:
        """Apply an insert: data [owned layers, 2, n, BS, Hkv, D] (None when this rank owns
        no layer) lands in the slots, which then hold these keys."""
        with self.lock:
            ids = torch.tensor(slots, dtype=torch.long)
            if data is not None and len(self.owned):
                self.kv[:, :, ids] = data
            for s, k in zip(slots, keys):
                self._drop(s)
                self.slot_key[s] = k
                self.index.setdefault(k, s)
                if self._mine(s):
                    self.lru[s] = None
                    self.lru.move_to_end(s)
            self.counters["group_inserted_blocks"] += len(slots)

    def gather(self, layer: int, slots: list[int], keys: list[bytes]) -> torch.Tensor | None:
        """Layer `layer` (owned here) of these slots, [2, n, BS, Hkv, D], or None when a
        slot no longer holds its key (evicted and reused meanwhile)."""
        with self.lock:
            if any(self.slot_key[s] != k for s, k in zip(slots, keys)):
                self.counters["group_stale_reads"] += 1
                return None
            for s in slots:
                if s in self.lru:
                    self.lru.move_to_end(s)
            return self.kv[self.local[layer], :, torch.tensor(slots, dtype=torch.long)]

    def clear(self) -> int:
        """Every entry is lost (a rank left or the group re-formed); returns how many."""
        with self.lock:
            n = len(self.index)
            self.index.clear()
            self.slot_key = [None] * self.num_slots
            per = self.num_slots // self.size
            self.lru.clear()
            self.free = deque(range(self.rank * per, (self.rank + 1) * per))
            self.counters["group_lost_blocks"] += n
            return n

    # ---- measurements ---------------------------------------------------------------------
    def stats(self) -> dict:
        with self.lock:
            held = sum(k is not None for k in self.slot_key)
            return {"group_slots": self.num_slots, "group_owned_layers": len(self.owned),
                    "group_index_blocks": len(self.index), "group_cached_blocks": held,
                    "group_cached_bytes": held * len(self.owned) * self.layer_block_bytes,
                    "group_store_bytes": self.kv.untyped_storage().nbytes(),
                    **self.counters}
