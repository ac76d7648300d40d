"""Attention the fused paths (kernels/: SDPA, the C++ row ops, the paged decode kernels)
do not compute: a sliding window (Mistral, Gemma's local layers, Qwen2/3 where enabled)
and soft-capped scores (Gemma 2). Plain torch, float32 math, the order transformers'
eager attention uses: scores * scale, soft-cap, mask, softmax, @ V.

Rows of one sequence are positions [context_len - n, context_len); each sees keys at
positions k with q - window < k <= q (window 0: every k <= q). Only the keys some row sees
are gathered, so a windowed layer's cost stops growing with the context.

A row computed alone (n = 1) runs the same ops on the same shapes whether it is a decode
step or one row of a deterministic-mode prompt, so both give the same bits."""
from __future__ import annotations

import torch


def attend_rows(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, ctx_slots: torch.Tensor,
                context_len: int, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
    """q: [n, Hq, D] rows of one sequence; kf/vf: [slots, Hkv, D] (the pool, flat);
    ctx_slots: flat slots of positions 0..context_len-1. Returns [n, Hq, D]."""
    n, Hq, D = q.shape
    Hkv = kf.shape[1]
    G = Hq // Hkv
    first = context_len - n
    lo = max(0, first - window + 1) if window else 0
    slots = ctx_slots[lo:context_len]
    ks = kf.index_select(0, slots).float()                          # [c, Hkv, D]
    vs = vf.index_select(0, slots).float()
    qg = q.float().view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
    s = torch.bmm(qg, ks.permute(1, 2, 0)).mul_(scale)              # [Hkv, n*G, c]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    dev = q.device
    qpos = torch.arange(first, context_len, device=dev).repeat_interleave(G).unsqueeze(1)
    kpos = torch.arange(lo, context_len, device=dev).unsqueeze(0)
    seen = kpos <= qpos
    if window:
        seen &= kpos > qpos - window
    p = torch.softmax(s.masked_fill_(~seen, float("-inf")), dim=-1)
    o = torch.bmm(p, vs.transpose(0, 1))                            # [Hkv, n*G, D]
    return o.view(Hkv, n, G, D).permute(1, 0, 2, 3).reshape(n, Hq, D).to(q.dtype)


def table_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The flat slots of positions 0..context_len-1 of a sequence whose blocks are
    block_table (one row of a decode batch's block tables)."""
    nb = -(-context_len // block_size)
    base = block_table[:nb].long().unsqueeze(1) * block_size
    offs = torch.arange(block_size, device=block_table.device).unsqueeze(0)
    return (base + offs).flatten()[:context_len]


def attend_decode(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode rows in one batch: q [B, Hq, D], row b the query at position
    context_lens[b] - 1 over its last min(context, window) keys, gathered from its block
    table and padded to the longest (padding masked). Faster than a row at a time; not
    batch-invariant (a row's reduction length is the batch's), so deterministic mode
    attends rows alone (attend_rows)."""
    B, Hq, D = q.shape
    Hkv = kf.shape[1]
    ctx = context_lens.long()
    span = ctx.clamp(max=window) if window else ctx
    L = int(span.max())
    pos = (ctx - span).unsqueeze(1) + torch.arange(L, device=q.device).unsqueeze(0)  # [B, L]
    seen = pos < ctx.unsqueeze(1)
    pos = torch.minimum(pos, (ctx - 1).unsqueeze(1))
    slots = (block_tables.long().gather(1, pos // block_size) * block_size
             + pos % block_size)
    ks, vs = kf[slots].float(), vf[slots].float()                    # [B, L, Hkv, D]
    s = torch.einsum("bhgd,blhd->bhgl", q.float().view(B, Hkv, Hq // Hkv, D), ks) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill_(~seen[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhgl,blhd->bhgd", p, vs).reshape(B, Hq, D).to(q.dtype)
