"""Triton paged-attention decode: one query token per sequence, KV read through a block table.

One program per (sequence, kv head). It loads the GROUP query heads that share the kv head
and walks the sequence's cache blocks with an online softmax, so each K/V block is read
once per group (GQA) and the scores never leave registers.
"""
import math

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, check_inner_contiguous, launchable, next_pow2

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr, q_ptr,  # both [B, Hq, D]
    k_cache_ptr, v_cache_ptr,  # both [NB, BS, Hkv, D], with the same strides
    block_tables_ptr, context_lens_ptr,  # [B, max_blocks] int32, [B] int32
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,  # tokens per cache block, head dim
    GROUP: tl.constexpr,  # Hq // Hkv
    BS_POW2: tl.constexpr, D_POW2: tl.constexpr, G_POW2: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, G_POW2)  # query heads of this kv head
    offs_t = tl.arange(0, BS_POW2)  # token offsets inside a cache block
    offs_d = tl.arange(0, D_POW2)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM

    # q: [G, D], pre-scaled
    q_heads = kv_head * GROUP + offs_g
    q_mask = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0).to(tl.float32)
    q = q * qk_scale

    m_i = tl.full([G_POW2], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([G_POW2], tl.float32)  # running sum of exp
    acc = tl.zeros([G_POW2, D_POW2], tl.float32)

    # [BS, D] offsets of this kv head's rows inside one cache block
    kv_offs = offs_t[:, None] * stride_ct + kv_head * stride_ch + offs_d[None, :]
    for j in range(0, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        # offs_t < BLOCK_SIZE matters when BLOCK_SIZE is not a power of two
        mask_t = (offs_t < BLOCK_SIZE) & (j * BLOCK_SIZE + offs_t < ctx_len)
        kv_mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + block * stride_cb + kv_offs, mask=kv_mask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + block * stride_cb + kv_offs, mask=kv_mask,
                    other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BS]
        s = tl.where(mask_t[None, :], s, float("-inf"))
        # every visited block holds >= 1 token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [G, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # context_len 0 -> zeros, not NaN
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    op = "paged_attention_decode"
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"{op}: k_cache must be [num_blocks, block_size, Hkv, D], got shape "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    B, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"{op}: head_dim mismatch: q has {D}, cache has {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"{op}: block_tables must be [B={B}, max_blocks], got shape "
                         f"{tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (B,):
        raise ValueError(f"{op}: context_lens must be [B={B}], got shape "
                         f"{tuple(context_lens.shape)}")

    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: q dtype {q.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{op}: dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache "
                         f"{v_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"{op}: block_tables and context_lens must be int32, "
                         f"got {block_tables.dtype} and {context_lens.dtype}")

    check_inner_contiguous(op, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache strides differ: {k_cache.stride()} vs "
                         f"{v_cache.stride()}")
    if not context_lens.is_contiguous():
        raise ValueError(f"{op}: context_lens must be contiguous")
    check_device(op, q, k_cache, v_cache, block_tables, context_lens)


def paged_attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    """out[B, Hq, D] = softmax(q . K^T * scale) . V over each sequence's first context_lens[b]
    tokens.

    Block-table entries past cdiv(context_lens[b], block_size) are never read (any padding
    value works). Values are not checked (that would sync the device): context_lens[b] must
    be <= max_blocks * block_size and the used block ids must be < num_blocks.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = Hq // Hkv
    kernel = launchable(_paged_attention_decode_kernel)
    kernel[(B, Hkv)](
        out, q, k_cache, v_cache, block_tables, context_lens,
        float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=BS, HEAD_DIM=D, GROUP=group,
        BS_POW2=next_pow2(BS), D_POW2=next_pow2(D), G_POW2=next_pow2(group),
    )
    return out
