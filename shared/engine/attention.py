"""Attention over the paged KV pool, as the model's forward calls it per layer:

    plan = attn.plan(meta, kv)                      once a forward: the decode gather plan
    o = attn(q, k_cache, v_cache, meta, plan)       a full-attention layer
    o = attn.masked(q, k_cache, v_cache, meta, w)   a sliding-window or soft-capped layer

Decode rows (the batch's leading rows) go through one batched paged-attention call
(kernels/paged_attention.py); every chunk span attends exactly its sequence's context,
one row at a time in deterministic mode (SeqSpan.rowwise) so that a prompt's KV is bit
for bit what decoding its tokens one by one gives. Masked layers: masked_attention.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_ops import load as cpu_ops_loaded, row_attention, rows_attention
from kernels.paged_attention import paged_attention_decode, plan_decode

from .batch import BatchMeta, SeqSpan
from .masked_attention import attend_decode, attend_rows, table_slots


class Attention:
    def __init__(self, num_kv_heads: int, head_dim: int, scale: float, softcap: float = 0.0):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scale, self.softcap = scale, softcap
        self.batched_decode = True     # masked layers' decode rows in one batch (bench: off)

    @staticmethod
    def plan(meta: BatchMeta, kv: torch.Tensor):
        """The torch decode attention's gather plan, shared by every layer; none on CUDA or
        where the C++ op reads the cache in place (kernels/cpu_ops)."""
        if not meta.num_decode or kv.is_cuda or cpu_ops_loaded():
            return None
        return plan_decode(meta.block_tables, meta.context_lens, kv.shape[3])

    def __call__(self, q, k_cache, v_cache, meta: BatchMeta, plan=None) -> torch.Tensor:
        """A full-attention layer: batched paged attention for the leading decode rows,
        each span over exactly its sequence's context: [T, Hq, D]."""
        nd, T = meta.num_decode, q.shape[0]
        if nd:
            od = paged_attention_decode(q[:nd], k_cache, v_cache, meta.block_tables,
                                        meta.context_lens, self.scale, plan)
            if nd == T:
                return od
        Hkv, D = self.num_kv_heads, self.head_dim
        kf, vf = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
        if len(meta.spans) == 1 and not nd and meta.spans[0].n == T:  # one span, every row
            return self._span(q, kf, vf, meta.spans[0])
        out = torch.zeros_like(q)
        if nd:
            out[:nd] = od
        for s in meta.spans:
            out[s.start:s.start + s.n] = self._span(q, kf, vf, s)
        return out

    def masked(self, q, k_cache, v_cache, meta: BatchMeta, window: int):
        """A sliding-window or soft-capped layer's attention (masked_attention.py): decode
        rows in one batch (each alone in deterministic mode, and with batched_decode off),
        every row of a deterministic-mode span alone."""
        Hkv, D = self.num_kv_heads, self.head_dim
        kf, vf = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
        att = lambda rows, slots, ctx: attend_rows(  # noqa: E731
            rows, kf, vf, slots, ctx, self.scale, window, self.softcap)
        out = torch.zeros_like(q)
        nd = meta.num_decode
        batched = self.batched_decode and not meta.det_tile
        if nd and batched:
            out[:nd] = attend_decode(q[:nd], kf, vf, meta.block_tables, meta.context_lens,
                                     k_cache.shape[1], self.scale, window, self.softcap)
        for b in range(0 if batched else nd):
            ctx = int(meta.context_lens[b])
            out[b:b + 1] = att(q[b:b + 1], table_slots(meta.block_tables[b], ctx,
                                                       k_cache.shape[1]), ctx)
        for s in meta.spans:
            if s.rowwise:
                first = s.context_len - s.n
                for i in range(s.n):
                    r = s.start + i
                    out[r:r + 1] = att(q[r:r + 1], s.ctx_slots, first + i + 1)
            else:
                out[s.start:s.start + s.n] = att(q[s.start:s.start + s.n], s.ctx_slots,
                                                 s.context_len)
        return out

    def _span(self, q, kf, vf, s: SeqSpan) -> torch.Tensor:
        """Rows of one sequence attended over exactly its context: [n, Hq, D]."""
        if s.rowwise and s.n > 1:
            return self._rowwise(q, kf, vf, s)
        if s.n == 1 and not q.is_cuda:
            return self._one_row(q[s.start], kf, vf, s.ctx_slots)
        qs = q[s.start:s.start + s.n].transpose(0, 1).unsqueeze(0)         # [1, Hq, n, D]
        ks = kf.index_select(0, s.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        vs = vf.index_select(0, s.ctx_slots).transpose(0, 1).unsqueeze(0)
        if s.n == 1:
            mask, causal = None, False
        elif s.n == s.context_len:
            mask, causal = None, True
        else:  # a later chunk: row i sees positions <= ctx - n + i
            dev = q.device
            qpos = torch.arange(s.context_len - s.n, s.context_len, device=dev).unsqueeze(1)
            mask = torch.arange(s.context_len, device=dev).unsqueeze(0) <= qpos
            causal = False
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _rowwise(self, q, kf, vf, s: SeqSpan) -> torch.Tensor:
        """Each row of the span exactly as a decode step of that position attends it
        (deterministic mode): a prompt's KV is then bit for bit the KV its tokens get when
        generated one by one, so a migrated request (prompt + tokens so far, recomputed as
        a prefill) goes on as the uninterrupted one, and a chunk split changes nothing."""
        out = rows_attention(q[s.start:s.start + s.n], kf, vf, s.ctx_slots, self.scale)
        if out is not None:
            return out
        first = s.context_len - s.n
        return torch.cat([self._span(q, kf, vf, SeqSpan(s.start + i, 1, first + i + 1,
                                                        s.ctx_slots[:first + i + 1]))
                          for i in range(s.n)])

    def _one_row(self, q, kf, vf, ctx_slots: torch.Tensor) -> torch.Tensor:
        """One query row (a decode step) over its context, [1, Hq, D]: two float32 bmms
        over the kv heads, on strided views of the gathered K/V. On CPU (SmolLM2's heads,
        bf16 KV, one thread) 2.6-4.2x faster than scaled_dot_product_attention for one
        row: 109 -> 42 us a layer at 100 tokens of context, 282 -> 67 us at 300. The C++
        op (kernels/cpu_ops) reads K/V in place instead: 86 -> 41 us at 100 (bfloat16)."""
        out = row_attention(q, kf, vf, ctx_slots, self.scale)
        if out is not None:
            return out.unsqueeze(0)
        Hkv, D = kf.shape[1], kf.shape[2]
        ks = kf.index_select(0, ctx_slots).float()                 # [ctx, Hkv, D]
        vs = vf.index_select(0, ctx_slots).float()
        qg = q.float().view(Hkv, -1, D)                            # [Hkv, G, D]
        p = torch.softmax(torch.bmm(qg, ks.permute(1, 2, 0)).mul_(self.scale), dim=-1)
        return torch.bmm(p, vs.transpose(0, 1)).reshape(1, -1, D).to(q.dtype)
