"""The LM head in two halves of the vocabulary, multiplied on two threads for small steps.

A batch-1 decode step is bandwidth-bound on one core, and the LM head is its largest
single weight (SmolLM2-135M int4: the int8 head is 28 MB of the 81 MB a step reads,
4.2 of 18.5 ms). With `head_split`, steps of at most PARALLEL_ROWS rows read one half on
a helper thread while the engine thread reads the other (the kernels release the GIL),
so a second core that is idle at low concurrency carries half of it. Larger steps, and
every step while the C++ matmuls share their work with their own helper thread
(`batch_helper`: each half already runs on both cores), multiply the halves one after the
other on the engine thread. Each output
column is the same dot product either way: the split never changes the logits.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels.cpu_ops.gemv import batch_helper_on

from .quant import refine_top

PARALLEL_ROWS = 2


class SplitHead:
    __slots__ = ("halves", "pool")

    def __init__(self, w: torch.Tensor, quantize: Callable[[torch.Tensor], object]):
        """w: the head [vocab, hidden]; quantize: a tensor -> a weight with mm(x)."""
        h = w.shape[0] // 2
        self.halves = (quantize(w[:h].contiguous()), quantize(w[h:].contiguous()))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="head")

    @property
    def shape(self) -> torch.Size:
        a, b = self.halves
        return torch.Size((a.shape[0] + b.shape[0], a.shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.halves)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.halves
        head = getattr(a, "head", False)    # (refined as one head: the same logits)
        ma, mb = (a.raw_mm, b.raw_mm) if head else (a.mm, b.mm)
        if x.shape[0] <= PARALLEL_ROWS and not x.is_cuda and not batch_helper_on():
            other = self.pool.submit(mb, x)
            out = torch.cat([ma(x), other.result()], dim=1)
        else:
            out = torch.cat([ma(x), mb(x)], dim=1)
        return refine_top(out.float(), x, self.rows) if head else out

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        a, b = self.halves
        h = a.shape[0]
        lo = idx < h
        return torch.where(lo.unsqueeze(-1), a.rows(idx.clamp(max=h - 1)),
                           b.rows((idx - h).clamp(min=0)))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([x.dequantize() for x in self.halves])
