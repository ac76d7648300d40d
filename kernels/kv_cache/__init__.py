"""KV-cache copies: Triton on CUDA caches, torch reference elsewhere."""
from dataclasses import dataclass

import torch

from kernels._optional import needs_triton
from kernels.kv_cache.ref import gather_blocks_ref, scatter_blocks_ref, write_kv_ref

try:        # Triton: the `cuda` extra (pip install "pdmesh[cuda]"); CPU serving runs without it
    from kernels.kv_cache.kernel import gather_blocks_triton, scatter_blocks_triton, write_kv_triton
except ImportError as e:
    gather_blocks_triton = scatter_blocks_triton = write_kv_triton = needs_triton(e)

__all__ = ["write_kv", "gather_blocks", "scatter_blocks", "SlotPlan", "plan_slots",
           "write_kv_ref", "gather_blocks_ref", "scatter_blocks_ref",
           "write_kv_triton", "gather_blocks_triton", "scatter_blocks_triton"]


@dataclass(slots=True)
class SlotPlan:
    """A forward's slot mapping, prepared once for every layer's write: the rows to keep
    (None: all of them) and their flat slots."""
    slot_mapping: torch.Tensor
    rows: torch.Tensor | None
    slots: torch.Tensor


def plan_slots(slot_mapping: torch.Tensor) -> SlotPlan:
    if slot_mapping.is_cuda:   # the Triton write skips -1 itself: no host sync to plan
        return SlotPlan(slot_mapping, None, slot_mapping)
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return SlotPlan(slot_mapping, None, slot_mapping.long())
    rows = keep.nonzero().flatten()
    return SlotPlan(slot_mapping, rows, slot_mapping.index_select(0, rows).long())


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: "torch.Tensor | SlotPlan") -> None:
    # k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slot_mapping: [T] int64, -1 = skip (in place)
    if k_cache.is_cuda:
        sm = slot_mapping.slot_mapping if isinstance(slot_mapping, SlotPlan) else slot_mapping
        return write_kv_triton(k, v, k_cache, v_cache, sm)
    if not isinstance(slot_mapping, SlotPlan) or not k_cache.is_contiguous():
        sm = slot_mapping.slot_mapping if isinstance(slot_mapping, SlotPlan) else slot_mapping
        return write_kv_ref(k, v, k_cache, v_cache, sm)
    p = slot_mapping
    if p.rows is not None:
        k, v = k.index_select(0, p.rows), v.index_select(0, p.rows)
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, Hkv, D).index_copy_(0, p.slots, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, p.slots, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # cache: [NB, BS, Hkv, D]; block_ids: [N] -> [N, BS, Hkv, D] contiguous
    if cache.is_cuda:
        return gather_blocks_triton(cache, block_ids)
    return gather_blocks_ref(cache, block_ids)


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
    # cache: [NB, BS, Hkv, D]; block_ids: [N]; data: [N, BS, Hkv, D] (in place)
    if cache.is_cuda:
        return scatter_blocks_triton(cache, block_ids, data)
    return scatter_blocks_ref(cache, block_ids, data)
