"""Triton KV-cache copies: write new K/V rows at flat slots, gather/scatter whole blocks.

Cache layout (docs/engine_layout.md): [num_blocks, block_size, Hkv, D]; a token's flat
slot is block_id * block_size + offset.
"""
import math

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, check_inner_contiguous, launchable, next_pow2

_TILE = 1024  # elements per program when copying whole blocks


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,  # [NB, BS, Hkv, D], same strides
    slot_ptr,  # [T] int64; -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_POW2: tl.constexpr,
    D_POW2: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_POW2)
    offs_d = tl.arange(0, D_POW2)
    # a skipped token (slot -1) masks every head; `(slot >= 0) & tensor` comes out int64 in
    # the interpreter, hence the where
    live_heads = tl.where(slot >= 0, NUM_HEADS, 0)
    mask = (offs_h[:, None] < live_heads) & (offs_d[None, :] < HEAD_DIM)  # [H, D]

    src_k = t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct \
        + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src_v, mask=mask), mask=mask)


@triton.jit
def _gather_blocks_kernel(
    cache_ptr,  # [NB, CHUNK] (contiguous blocks)
    ids_ptr,  # [N]
    out_ptr,  # [N, CHUNK]
    CHUNK: tl.constexpr,  # BS * Hkv * D
    TILE: tl.constexpr,
):
    n = tl.program_id(0)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < CHUNK
    block = tl.load(ids_ptr + n).to(tl.int64)
    x = tl.load(cache_ptr + block * CHUNK + offs, mask=mask)
    tl.store(out_ptr + n.to(tl.int64) * CHUNK + offs, x, mask=mask)


@triton.jit
def _scatter_blocks_kernel(
    cache_ptr,  # [NB, CHUNK]
    ids_ptr,  # [N]
    data_ptr,  # [N, CHUNK]
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
):
    n = tl.program_id(0)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < CHUNK
    block = tl.load(ids_ptr + n).to(tl.int64)
    x = tl.load(data_ptr + n.to(tl.int64) * CHUNK + offs, mask=mask)
    tl.store(cache_ptr + block * CHUNK + offs, x, mask=mask)


def _check_cache(op: str, name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{op}: {name} must be [num_blocks, block_size, Hkv, D], got shape "
                         f"{tuple(cache.shape)}")


def _check_block_ids(op: str, block_ids: torch.Tensor) -> None:
    if block_ids.dim() != 1:
        raise ValueError(f"{op}: block_ids must be 1-D [N], got shape {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: block_ids must be int32 or int64, got {block_ids.dtype}")
    if not block_ids.is_contiguous():
        raise ValueError(f"{op}: block_ids must be contiguous")


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache[slot // BS, slot % BS] = k/v[t] for every t with slot_mapping[t] >= 0.

    Slots are not range-checked (that would sync the device): each must be -1 or < NB * BS.
    Two tokens writing one slot leave either row.
    """
    op = "write_kv"
    _check_cache(op, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    _, BS, Hkv, D = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (Hkv, D) or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must both be [T, Hkv={Hkv}, D={D}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    T = k.shape[0]
    if tuple(slot_mapping.shape) != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"{op}: slot_mapping must be int64 [T={T}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"{op}: dtype mismatch: k {k.dtype}, v {v.dtype}, "
                         f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    check_inner_contiguous(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache strides differ: {k_cache.stride()} vs "
                         f"{v_cache.stride()}")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"{op}: slot_mapping must be contiguous")
    check_device(op, k, v, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    launchable(_write_kv_kernel)[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=BS, NUM_HEADS=Hkv, HEAD_DIM=D, H_POW2=next_pow2(Hkv), D_POW2=next_pow2(D),
    )


def gather_blocks_triton(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """out[i] = cache[block_ids[i]] -> [N, BS, Hkv, D], contiguous. Ids are not range-checked."""
    op = "gather_blocks"
    _check_cache(op, "cache", cache)
    _check_block_ids(op, block_ids)
    if not cache.is_contiguous():
        raise ValueError(f"{op}: cache must be contiguous, got strides {cache.stride()}")
    check_device(op, cache, block_ids)
    N = block_ids.shape[0]
    out = torch.empty((N, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    chunk = math.prod(cache.shape[1:])  # elements per block
    if N == 0 or chunk == 0:
        return out
    launchable(_gather_blocks_kernel)[(N, triton.cdiv(chunk, _TILE))](
        cache, block_ids, out, CHUNK=chunk, TILE=_TILE)
    return out


def scatter_blocks_triton(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
    """cache[block_ids[i]] = data[i], in place. Duplicate ids leave either block; ids are not
    range-checked."""
    op = "scatter_blocks"
    _check_cache(op, "cache", cache)
    _check_block_ids(op, block_ids)
    N = block_ids.shape[0]
    if tuple(data.shape) != (N, *cache.shape[1:]):
        raise ValueError(f"{op}: data must be [N={N}, {', '.join(map(str, cache.shape[1:]))}], "
                         f"got {tuple(data.shape)}")
    if data.dtype != cache.dtype:
        raise ValueError(f"{op}: dtype mismatch: cache {cache.dtype}, data {data.dtype}")
    if not cache.is_contiguous() or not data.is_contiguous():
        raise ValueError(f"{op}: cache and data must be contiguous")
    check_device(op, cache, block_ids, data)
    chunk = math.prod(cache.shape[1:])  # elements per block
    if N == 0 or chunk == 0:
        return
    launchable(_scatter_blocks_kernel)[(N, triton.cdiv(chunk, _TILE))](
        cache, block_ids, data, CHUNK=chunk, TILE=_TILE)
