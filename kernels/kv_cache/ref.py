"""Torch references for the KV-cache copies; also the engine's CPU path."""
import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slot_mapping: [T], -1 = skip
    BS = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, offset = slots // BS, slots % BS
    k_cache[block, offset] = k[keep]
    v_cache[block, offset] = v[keep]


def gather_blocks_ref(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # cache: [NB, BS, Hkv, D]; block_ids: [N] -> [N, BS, Hkv, D]
    return cache.index_select(0, block_ids.long())


def scatter_blocks_ref(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
    # cache: [NB, BS, Hkv, D]; block_ids: [N]; data: [N, BS, Hkv, D]
    cache.index_copy_(0, block_ids.long(), data)
