"""Torch reference for paged-attention decode; also the engine's CPU path.

Vectorised over the batch: gather every sequence's blocks up to the longest context,
mask the padding, softmax in float32. The short loop over kv heads lets each bmm read a
strided view of the gathered K/V; one 4-D matmul would first copy them heads-first
(measured ~2x slower on CPU; a loop over sequences lost when contexts were short).
"""
import torch


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    # q: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]
    # block_tables: [B, max_blocks]; context_lens: [B] -> out: [B, Hq, D]
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    lens = context_lens.to(device=q.device, dtype=torch.long)
    max_len = int(lens.max()) if B else 0
    if max_len == 0:
        return q.new_zeros((B, Hq, D))
    nb = -(-max_len // BS)
    L = nb * BS

    # entries past a sequence's last block may be padding (e.g. -1): point them at block 0
    tables = block_tables[:, :nb].to(device=q.device, dtype=torch.long)  # [B, nb]
    used = torch.arange(nb, device=q.device) * BS < lens[:, None]
    tables = torch.where(used, tables, 0).flatten()
    k = k_cache.index_select(0, tables).view(B, L, Hkv, D).float()  # [B, L, Hkv, D]
    v = v_cache.index_select(0, tables).view(B, L, Hkv, D).float()

    qg = q.float().reshape(B, Hkv, G, D)
    pad = (torch.arange(L, device=q.device) >= lens[:, None])[:, None, :]  # [B, 1, L]
    out = torch.empty((B, Hkv, G, D), dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) * scale  # [B, G, L]
        scores.masked_fill_(pad, float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h], out=out[:, h])
    out.masked_fill_((lens == 0)[:, None, None, None], 0.0)  # empty context: NaN -> 0
    return out.view(B, Hq, D).to(q.dtype)
