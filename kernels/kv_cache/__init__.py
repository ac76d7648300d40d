"""KV-cache copies: Triton on CUDA caches, torch reference elsewhere."""
import torch

from kernels.kv_cache.kernel import gather_blocks_triton, scatter_blocks_triton, write_kv_triton
from kernels.kv_cache.ref import gather_blocks_ref, scatter_blocks_ref, write_kv_ref

__all__ = ["write_kv", "gather_blocks", "scatter_blocks",
           "write_kv_ref", "gather_blocks_ref", "scatter_blocks_ref",
           "write_kv_triton", "gather_blocks_triton", "scatter_blocks_triton"]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slot_mapping: [T] int64, -1 = skip (in place)
    if k_cache.is_cuda:
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


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
