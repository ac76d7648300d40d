"""Paged KV block allocator with a prefix index (tier L1): pure bookkeeping, no tensors.

Blocks are reference counted. A block whose KV covers a whole block of a prompt can be
registered under its prefix key (shared/engine/prefix.py); later requests with the same
prefix take it (ref + 1) instead of computing it. A registered block whose count drops
to zero stays cached ("evictable") and is reused, least recently used first, only when
no never-cached block is free: eviction drops its key.

Each allocation stamps the block with a new epoch, so a stale writer (one that was given
the block under an earlier epoch) can be recognised and fenced off. Every epoch is drawn
at random (63 bits, from the OS's CSPRNG), not counted: an epoch seen in one job says
nothing about any other block's, so a writer cannot aim a write at blocks it was not
given by guessing their epochs, and a write issued to a previous life of this process
(same instance id, same block ids) names epochs this life will practically never hand
out. Cached blocks are never handed to a remote writer: only freshly allocated blocks are.
"""
from __future__ import annotations

import secrets
from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation right now (callers queue or preempt)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, epoch_base: int | None = None):
        """epoch_base: TEST ONLY, count epochs up from it instead of drawing them."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._key: dict[int, bytes] = {}            # block -> prefix key
        self._cached: dict[bytes, int] = {}         # prefix key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, ref 0, LRU first
        self.epoch = [0] * num_blocks
        self._next_epoch: int | None = epoch_base      # None: random epochs
        self.hits = 0           # blocks served from the prefix index
        self.queries = 0        # blocks looked up
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have (never-cached ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._key.pop(b)]
                self.evictions += 1
            self._ref[b] = 1
            self._stamp(b)
            out.append(b)
        return out

    def restamp(self, blocks: list[int]) -> None:
        """New epochs for blocks that stay allocated: fences every earlier writer."""
        for b in blocks:
            self._stamp(b)

    def _stamp(self, b: int) -> None:
        if self._next_epoch is None:
            self.epoch[b] = secrets.randbits(63) | 1      # never 0 (a never-allocated block)
        else:
            self.epoch[b] = self._next_epoch
            self._next_epoch += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._key:
                    self._evictable[b] = None       # most recently used at the end
                else:
                    self._free.append(b)

    # ---- prefix index (L1) ----------------------------------------------------------
    def match(self, keys: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `keys` (no references taken)."""
        out = []
        for k in keys:
            b = self._cached.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int], queried: int = 0) -> None:
        """Reference cached blocks (from match) for a new user."""
        self.queries += queried
        self.hits += len(blocks)
        for b in blocks:
            if self._ref[b] == 0:
                self._evictable.pop(b)
            self._ref[b] += 1

    def register(self, block: int, key: bytes) -> bool:
        """Index a held block whose KV is complete under its prefix key. False when the
        key is already cached in another block (the first copy stays) or the block
        already has a key."""
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if key in self._cached or block in self._key:
            return False
        self._cached[key] = block
        self._key[block] = key
        return True

    def stats(self) -> dict:
        return {"l1_cached_blocks": len(self._cached), "l1_evictable_blocks": len(self._evictable),
                "l1_hit_blocks": self.hits, "l1_query_blocks": self.queries,
                "l1_hit_rate": round(self.hits / self.queries, 4) if self.queries else 0.0,
                "l1_evictions": self.evictions}
