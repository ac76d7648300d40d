"""Torch reference for paged-attention decode; also the engine's CPU path.

Vectorised over the batch: gather every sequence's blocks up to the longest context,
mask the padding, softmax in float32. The gathered K/V turn heads-first in the copy that
makes them float32 anyway, so two bmms over B * Hkv matrices do the rest (a loop over
sequences loses while contexts are short: shared/engine/batch.py picks).

The gather indices and the padding mask depend only on the block tables and context
lengths, which every layer of a forward shares: `plan_decode` makes them once and each
layer's call takes the plan.
"""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodePlan:
    lens: torch.Tensor      # [B] int64
    tables: torch.Tensor    # [B * nb] int64 block ids (unused entries point at block 0)
    pad: torch.Tensor       # [B, 1, L] bool: past the context
    empty: torch.Tensor     # [B] bool: zero-length context
    L: int                  # nb * block_size (0: every context empty)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                device=None) -> DecodePlan:
    device = device or block_tables.device
    lens = context_lens.to(device=device, dtype=torch.long)
    B = lens.shape[0]
    max_len = int(lens.max()) if B else 0
    nb = -(-max_len // block_size)
    L = nb * block_size
    # entries past a sequence's last block may be padding (e.g. -1): point them at block 0
    tables = block_tables[:, :nb].to(device=device, dtype=torch.long)  # [B, nb]
    used = torch.arange(nb, device=device) * block_size < lens[:, None]
    tables = torch.where(used, tables, 0).flatten()
    pad = (torch.arange(L, device=device) >= lens[:, None])[:, None, :]  # [B, 1, L]
    return DecodePlan(lens, tables, pad, lens == 0, L)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, plan: DecodePlan | None = None) -> torch.Tensor:
    # q: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]
    # block_tables: [B, max_blocks]; context_lens: [B] -> out: [B, Hq, D]
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    p = plan or plan_decode(block_tables, context_lens, BS, q.device)
    if p.L == 0:
        return q.new_zeros((B, Hq, D))
    # heads-first in the one copy that makes them float32 (`to` alone would keep a float32
    # cache's strides): each bmm then runs over B * Hkv contiguous matrices (a strided
    # view per kv head was 1.3-1.5x slower)
    k = (k_cache.index_select(0, p.tables).view(B, p.L, Hkv, D).transpose(1, 2)
         .to(torch.float32, memory_format=torch.contiguous_format).contiguous())  # [B,Hkv,L,D]
    v = (v_cache.index_select(0, p.tables).view(B, p.L, Hkv, D).transpose(1, 2)
         .to(torch.float32, memory_format=torch.contiguous_format).contiguous())
    qg = q.float().reshape(B * Hkv, G, D)
    scores = torch.bmm(qg, k.view(B * Hkv, p.L, D).transpose(1, 2)).mul_(scale)
    scores.view(B, Hq, p.L).masked_fill_(p.pad, float("-inf"))        # [B*Hkv, G, L]
    out = torch.bmm(torch.softmax(scores, dim=-1), v.view(B * Hkv, p.L, D)).view(B, Hq, D)
    out.masked_fill_(p.empty[:, None, None], 0.0)  # empty context: NaN -> 0
    return out.to(q.dtype)
