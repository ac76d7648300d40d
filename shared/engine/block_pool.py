"""Paged KV block allocator: pure bookkeeping, no tensors, no I/O.

Blocks are handed out from a free list and come back on free. Each allocation stamps
the block with a new epoch, so a stale writer (one that was given the block under an
earlier epoch) can be recognised and fenced off.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation right now (callers queue or preempt)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()
        self.epoch = [0] * num_blocks
        self._next_epoch = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._used.add(b)
            self.epoch[b] = self._next_epoch
            self._next_epoch += 1
        return out

    def restamp(self, blocks: list[int]) -> None:
        """New epochs for blocks that stay allocated: fences every earlier writer."""
        for b in blocks:
            self.epoch[b] = self._next_epoch
            self._next_epoch += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)
