"""The one forward pass (Llama and the families archs.py describes) over a paged KV pool.

One forward takes a flat batch of T token rows drawn from several sequences (prefill
chunks and decode tokens mixed), writes each row's K/V into its slot, and attends each
row over its sequence's blocks. Linear layers run on the whole flat batch.

Batch invariance (deterministic mode): a GEMM row's result depends on the GEMM's M on
this CPU, but not on the other rows' values or on the row's position. So in deterministic
mode every matmul runs in tiles of a fixed number of rows (meta.det_tile: linear pads the
last one), every other op is row by row, and attention runs per sequence on exactly that
sequence's context; a request's logits are then the same whatever else is in the batch.
A plain weight on a CPU the C++ ops run on skips the tiles: their float_gemv computes each
row the same way at any row count, at the cost of the rows it has (a one-row decode step
paid for 16 in the tiles).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.cpu_ops import load as cpu_ops_loaded
from kernels.cpu_ops.build import cpu_has
from kernels.cpu_ops.gemv import float_gemv, float_gemv_ready
from kernels.kv_cache import plan_slots, write_kv

from .archs import ACTIVATIONS
from .attention import Attention
from .batch import BatchMeta, SeqSpan
from .head import SplitHead
from .loader import ModelConfig, load_weights
from .moe import expert_weights, route
from .quant import quantize_weight, weight_nbytes
from .rope import rope_cos_sin
from .smooth import CALIBRATION_TOKENS, Observed, SmoothedWeight, smoothing


class Layer:
    __slots__ = ("ln1", "ln2", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "gate_up_w",
                 "down_w", "post_attn", "post_mlp", "router", "experts", "window", "rope")


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 quantize: str = "", act_int8: bool = False, head_split: bool = False,
                 smooth_ids: list[int] | None = None):
        """weights on the device the model runs on; quantize: '' | 'int8' | 'int4'
        (quant.py) for the linear layers and the LM head; act_int8: their batches on int8
        activations (W8A8); head_split: a quantized LM head in two halves, on two threads
        for small steps (head.py); smooth_ids (with act_int8, on CPU): calibration tokens
        for SmoothQuant, which puts q|k|v and down on W8A8 too (smooth.py)."""
        self.cfg = cfg
        self.dtype = dtype
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.gemma = bool(cfg.arch is not None and cfg.arch.gemma)
        self.embed = weights["model.embed_tokens.weight"]
        self.device = self.embed.device
        self.norm = self._norm_weight(weights["model.norm.weight"])
        self.gelu = ACTIVATIONS.get(cfg.act)      # None: SiLU; else torch's gelu approximate
        self.attn = Attention(cfg.num_kv_heads, cfg.head_dim, self.scale, cfg.attn_softcap)
        head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        qh = lambda t: quantize_weight(t, quantize, head=True, a8=act_int8)  # noqa: E731
        self.lm_head = SplitHead(head, qh) if head_split and quantize else qh(head)
        # called as layer_listener(layer, meta) in the forward's thread once the layer's KV
        # is in the pool: prefill streams it to decode while later layers compute
        self.layer_listener = None
        self.layers: list[Layer] = []
        for i in range(cfg.num_layers):
            self.layers.append(self._layer(cfg, weights, f"model.layers.{i}.", quantize,
                                           act_int8))
        self.interleaved = bool(cfg.arch is not None and cfg.arch.interleaved_rope)
        # RoPE tables by layer type (Gemma 3 gives sliding layers their own base), each
        # [max_position, D]
        self.tables = {}
        for L in self.layers:
            if L.rope not in self.tables:
                cos, sin = (interleaved_tables if self.interleaved else half_tables)(
                    *rope_cos_sin(cfg, dtype, L.rope), cfg.head_dim)
                self.tables[L.rope] = cos.to(self.device), sin.to(self.device)
        if smooth_ids and quantize and act_int8 and self.device.type == "cpu":
            self._smooth(weights, smooth_ids)

    def _smooth(self, weights: dict, ids: list[int]) -> None:
        """SmoothQuant for q|k|v and down: forwards over `ids` record each one's
        per-channel max|x|, then each becomes a SmoothedWeight over its own base."""
        for L in self.layers:
            L.qkv_w = Observed(L.qkv_w)
            if L.experts is None:
                L.down_w = Observed(L.down_w)
        n = min(CALIBRATION_TOKENS, self.cfg.max_position)
        for s in range(0, len(ids), n):
            chunk = ids[s:s + n]
            self.forward(torch.tensor(chunk), *one_prompt(self.cfg, len(chunk), self.dtype))
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            for attr, w in (("qkv_w", _qkv(weights, p)),
                            ("down_w", weights.get(p + "mlp.down_proj.weight"))):
                if w is None:      # a MoE layer: its experts stay as they are
                    continue
                seen = getattr(L, attr)
                setattr(L, attr, SmoothedWeight(seen.base, w, smoothing(w, seen.amax)))

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm scales by (1 + w), in float32: kept so (rms_norm)."""
        return 1.0 + w.float() if self.gemma else w

    def _layer(self, cfg: ModelConfig, weights: dict, p: str, quantize: str, a8: bool) -> Layer:
        """a8 (act_int8) only where 8-bit rows cost nothing measurable: the inputs of q|k|v
        and of down carry outlier channels (SmolLM2 int4, prose perplexity 14.29: +0.37
        and +0.22 with theirs on int8, +0.00 for o and gate|up, +0.09 for the head)."""
        w = lambda n: weights[p + n]  # noqa: E731
        q = lambda t: quantize_weight(t, quantize)  # noqa: E731
        q8 = lambda t: quantize_weight(t, quantize, a8=a8)  # noqa: E731
        L = Layer()
        norms = (cfg.arch.norms if cfg.arch is not None
                 else ("input_layernorm", None, "post_attention_layernorm", None))
        L.ln1, L.post_attn, L.ln2, L.post_mlp = (
            self._norm_weight(w(n + ".weight")) if n else None for n in norms)
        L.window = cfg.layer_windows[int(p.split(".")[2])] if cfg.layer_windows else 0
        L.rope = "sliding_attention" if L.window else "full_attention"
        # fused projections: one GEMM for q|k|v and one for gate|up
        L.qkv_w = q(_qkv(weights, p))
        L.qkv_b = (torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                              w("self_attn.v_proj.bias")]) if cfg.attention_bias else None)
        L.o_w = q8(w("self_attn.o_proj.weight"))
        L.o_b = w("self_attn.o_proj.bias") if cfg.o_bias else None
        L.q_norm, L.k_norm = ((self._norm_weight(w("self_attn.q_norm.weight")),
                               self._norm_weight(w("self_attn.k_norm.weight")))
                              if cfg.qk_norm else (None, None))
        L.router = L.experts = L.gate_up_w = L.down_w = None
        if cfg.moe_layers and cfg.moe_layers[int(p.split(".")[2])]:
            L.router = w("mlp.gate.weight")       # [E, H], unquantized: it picks experts
            L.experts = [(q8(gu), q(d)) for gu, d in expert_weights(weights, p, cfg.num_experts)]
        else:
            L.gate_up_w = q8(_gate_up(weights, p))
            L.down_w = q(w("mlp.down_proj.weight"))
        return L

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer, the final norm and the
        LM head (an untied embedding table is only indexed, one row per token)."""
        tensors = [self.norm, self.lm_head] + [
            getattr(L, a) for L in self.layers for a in Layer.__slots__
            if a not in ("window", "rope", "experts")]
        routed = sum(weight_nbytes(t) for L in self.layers for e in (L.experts or ())
                     for t in e)       # a token reads experts_per_tok of num_experts
        share = self.cfg.experts_per_tok / self.cfg.num_experts if routed else 0
        return sum(weight_nbytes(t) for t in tensors) + int(routed * share)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # float32 math, then back to the model dtype (as transformers does); Gemma scales
        # in float32 too, by its (1 + w) (_norm_weight). On CPU one C++ call (cpu_ops)
        y = cpu_ops.rms_norm(x, w, self.cfg.rms_norm_eps, self.gemma)
        if y is not None:
            return y
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_norm_eps)
        return (xf * w).to(x.dtype) if self.gemma else w * xf.to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos/sin: [T, 1, D], sin with rot's sign folded in (__init__):
        # the same products as x * cos + cat([-x2, x1]) * sin, one op fewer; interleaved
        # (GLM-4), rot pairs (2i, 2i+1) instead of halves. On CPU one C++ call (cpu_ops)
        y = cpu_ops.rope(x, cos, sin, self.interleaved)
        if y is not None:
            return y
        if self.interleaved:
            return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, kv: torch.Tensor) -> torch.Tensor:
        """input_ids: [T]; kv: [layers, 2, blocks, block_size, Hkv, D]. Returns logits
        [S, V] (float32, on the host: sampling is seeded per position there) for
        meta.logits_rows. A batch built on the host moves to the model's device first."""
        if self.device.type != "cpu":
            input_ids, meta = to_device(input_ids, meta, self.device)
        cfg = self.cfg
        T = input_ids.shape[0]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tile = meta.det_tile
        h = F.embedding(input_ids, self.embed)                       # [T, H]
        if self.gemma:      # embeddings scaled by sqrt(hidden), in the model dtype
            h = h * torch.tensor(cfg.hidden_size ** 0.5, dtype=h.dtype)
        rot = {k: (c[meta.positions].unsqueeze(1), s[meta.positions].unsqueeze(1))
               for k, (c, s) in self.tables.items()}                 # [T, 1, D] each
        slots = plan_slots(meta.slot_mapping)      # shared by every layer's KV write
        plan = self.attn.plan(meta, kv)
        for li, L in enumerate(self.layers):
            x = self.rms_norm(h, L.ln1)
            qkv = linear(x, L.qkv_w, L.qkv_b, tile)                  # [T, (Hq+2Hkv)*D]
            qk = qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
            if L.q_norm is not None:                                 # Qwen3: per head
                qk = torch.cat([self.rms_norm(qk[:, :Hq], L.q_norm),
                                self.rms_norm(qk[:, Hq:], L.k_norm)], dim=1)
            qk = self.rope(qk, *rot[L.rope])
            q, k = qk[:, :Hq], qk[:, Hq:]
            v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            k_cache, v_cache = kv[li, 0], kv[li, 1]
            write_kv(k, v, k_cache, v_cache, slots)
            if self.layer_listener is not None:
                self.layer_listener(li, meta)
            for ld in meta.loads:   # readiness guard: layer li of a prefix load has landed
                ld.wait(li, meta.load_timeout_s)
            if L.window or cfg.attn_softcap:
                o = self.attn.masked(q, k_cache, v_cache, meta, L.window)
            else:
                o = self.attn(q, k_cache, v_cache, meta, plan)  # [T, Hq, D]
            o = linear(o.reshape(T, Hq * D), L.o_w, L.o_b, tile)
            h = h + (o if L.post_attn is None else self.rms_norm(o, L.post_attn))
            x = self.rms_norm(h, L.ln2)
            if L.experts is not None:
                m = self.moe(x, L, tile)
            else:
                m = self.mlp(x, L.gate_up_w, L.down_w, tile)
            h = h + (m if L.post_mlp is None else self.rms_norm(m, L.post_mlp))
        rows = h if meta.logits_rows is None else h[meta.logits_rows]
        logits = linear(self.rms_norm(rows, self.norm), self.lm_head, None, tile).float().cpu()
        if cfg.final_softcap:       # Gemma 2: logits soft-capped
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def mlp(self, x: torch.Tensor, gate_up_w, down_w, tile: int = 0) -> torch.Tensor:
        gu = linear(x, gate_up_w, None, tile)
        act = cpu_ops.silu_mul(gu) if self.gelu is None else None   # on CPU one C++ call
        if act is not None:
            return linear(act, down_w, None, tile)
        gate, up = gu.chunk(2, dim=-1)
        gate = F.silu(gate) if self.gelu is None else F.gelu(gate, approximate=self.gelu)
        return linear(gate * up, down_w, None, tile)

    def moe(self, x: torch.Tensor, L: Layer, tile: int = 0) -> torch.Tensor:
        """A sparse layer (moe.py): the router's logits, then the routed experts."""
        return route(x, linear(x, L.router, None, tile), L.experts, self.cfg,
                     lambda xe, gu, down: self.mlp(xe, gu, down, tile))



def half_tables(cos: torch.Tensor, sin: torch.Tensor, D: int):
    """RoPE on halves (x1, x2): rot(x) = [-x2, x1], its sign folded into sin."""
    half = D // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


def interleaved_tables(cos: torch.Tensor, sin: torch.Tensor, D: int):
    """RoPE on pairs (x[2i], x[2i+1]) of the first R dims (R = cos's width, a fraction of
    the head's D): frequency i for both of pair i, rot(x) = (-x[2i+1], x[2i]) with its sign
    folded into sin; the other D - R dims pass unturned (cos 1, sin 0)."""
    P, R = cos.shape
    c = cos[:, :R // 2].repeat_interleave(2, dim=-1)
    s = sin[:, :R // 2].repeat_interleave(2, dim=-1)
    s = s * torch.tensor([-1.0, 1.0], dtype=s.dtype).repeat(R // 2)
    return (torch.cat([c, c.new_ones(P, D - R)], dim=-1),
            torch.cat([s, s.new_zeros(P, D - R)], dim=-1))


def _gate_up(weights: dict, p: str) -> torch.Tensor:
    """gate|up as one [2I, H] weight (Phi-3 stores it so)."""
    if p + "mlp.gate_up_proj.weight" in weights:
        return weights[p + "mlp.gate_up_proj.weight"]
    return torch.cat([weights[p + "mlp.gate_proj.weight"],
                      weights[p + "mlp.up_proj.weight"]]).contiguous()


def _qkv(weights: dict, p: str) -> torch.Tensor:
    """The fused q|k|v projection of layer prefix p: one GEMM (Phi-3 stores it so)."""
    if p + "self_attn.qkv_proj.weight" in weights:
        return weights[p + "self_attn.qkv_proj.weight"]
    return torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).contiguous()


def one_prompt(cfg: ModelConfig, T: int, dtype: torch.dtype,
               every_row: bool = False) -> tuple[BatchMeta, torch.Tensor]:
    """(meta, scratch KV) to compute one T-token prompt in one forward, outside any
    engine (calibration, perplexity): the last row's logits, or every row's."""
    slots = torch.arange(T)
    meta = BatchMeta(positions=slots, slot_mapping=slots, spans=[SeqSpan(0, T, T, slots)],
                     logits_rows=slots if every_row else slots[-1:])
    return meta, kv_pool(cfg, T, 1, dtype)


def load_model(path, mc: ModelConfig, cfg, quantize: str | None = None,
               smooth_ids: list[int] | None = None) -> Model:
    """The checkpoint at path as the engine settings (EngineConfig) say: dtype, quantize
    (unless given), device; smooth_ids: SmoothQuant's calibration tokens."""
    device = cfg.device
    return Model(mc, load_weights(path, mc, cfg.torch_dtype, device), cfg.torch_dtype,
                 cfg.quantize if quantize is None else quantize,
                 cfg.act_int8, cfg.head_split and quantize is None, smooth_ids)


def kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
            device: str | torch.device = "cpu") -> torch.Tensor:
    """A paged KV pool: [layers, 2, blocks, block_size, Hkv, D] zeros. A host pool loads
    the C++ ops now (its attention and its KV wire use them), not on the event loop at the
    first decode step or KV write."""
    if torch.device(device).type == "cpu":
        cpu_ops_loaded()
    return torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads,
                       cfg.head_dim, dtype=dtype, device=device)


def to_device(input_ids: torch.Tensor, meta: BatchMeta, device: torch.device):
    """A batch built on the host (batch.py, spec/runner.py) moved to the model's device."""
    mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    spans = [dataclasses.replace(s, ctx_slots=mv(s.ctx_slots)) for s in meta.spans]
    meta = dataclasses.replace(meta, positions=mv(meta.positions),
                               slot_mapping=mv(meta.slot_mapping),
                               block_tables=mv(meta.block_tables),
                               context_lens=mv(meta.context_lens), spans=spans,
                               logits_rows=mv(meta.logits_rows))
    return mv(input_ids), meta


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of kv_pool (every layer, K and V)."""
    return (cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim
            * torch.tensor([], dtype=dtype).element_size())


# A CPU without bfloat16 dot products (AVX512-BF16, AMX): torch's bfloat16 GEMM runs 2-8x
# slower there than float32's from 8 rows on, the weight widened to float32 each call
# included (scripts/bench_bf16_linear.py). The widening (~0.25 ns a weight in cache, more
# from memory) outweighs the gain below 8 rows, and below 32 for a weight as large as an
# LM head. The same products, summed in float32 and rounded once, as the bfloat16 GEMM
# does; only the order of the sum may differ (1 ulp, ~1e-4 of the outputs).
NATIVE_BF16 = cpu_has("avx512_bf16", "amx_bf16")
F32_MIN_ROWS, F32_BIG_ROWS, BIG_WEIGHT = 8, 32, 1 << 23


def _f32_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T multiplies in float32 (above)."""
    m = x.shape[0]
    return (m >= F32_MIN_ROWS and w.dtype == torch.bfloat16 and not NATIVE_BF16
            and not w.is_cuda and (m >= F32_BIG_ROWS or w.numel() < BIG_WEIGHT))


@functools.cache
def _float_gemv_ready() -> bool:
    return float_gemv_ready()


def _row_invariant(w) -> bool:
    """Whether deterministic mode's x @ w.T goes through float_gemv (whose rows do not
    depend on the batch) rather than padded tiles."""
    if not isinstance(w, torch.Tensor) or w.is_cuda or not w.is_contiguous() \
            or w.dtype not in (torch.float32, torch.bfloat16):
        return False
    return _float_gemv_ready()


NARROW_ROWS = 8      # above: the weight is read from cache, and widening it costs more


def _narrowed(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight whose every value is a bfloat16 one (a checkpoint stored in
    bfloat16, loaded as float32: most are), as those bfloat16 bits; any other weight as it
    is. float_gemv widens bfloat16 back to float32 exactly, so its products and sums are
    the same bits, read from half the bytes: a decode step streams every weight from
    memory (tiny-target's float32 matmuls at one row: 1.90 -> 0.62 ms a step). Checked
    once per weight; the copy is kept beside the weight (1.5x its memory)."""
    n = w.__dict__.get("_bf16_exact")
    if n is None:
        n = False
        if w.dtype == torch.float32:
            b = w.to(torch.bfloat16)
            if torch.equal(b.float(), w):
                n = b
        w._bf16_exact = n
    return w if n is False else n


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None, tile: int = 0) -> torch.Tensor:
    """x @ w.T (+ b); w a tensor or a quantized weight (quant.py: w.mm). A single row of a
    plain CPU weight goes through mv: on CPU it streams the weight ~1.7x faster than the
    GEMM path (measured with bf16 weights, one thread). tile (deterministic mode): the rows
    in pieces of exactly `tile` rows, the last padded with zeros, so a row's result depends
    on neither the batch's size nor its neighbours (and never takes the one-row path); a
    plain CPU weight where the C++ ops run goes through float_gemv instead, which has that
    property at any row count."""
    if tile and x.shape[0] and _row_invariant(w):
        y = float_gemv(x, _narrowed(w) if x.shape[0] <= NARROW_ROWS else w)
        return y if b is None else y + b
    if tile and x.shape[0]:
        M = x.shape[0]
        pad = -M % tile
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        parts = [linear(x[i:i + tile], w, b) for i in range(0, M + pad, tile)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[:M]
    if not isinstance(w, torch.Tensor):
        y = w.mm(x)
    elif x.shape[0] == 1 and not x.is_cuda:
        y = torch.mv(w, x[0]).unsqueeze(0)
    elif _f32_rows(x, w):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    else:
        return F.linear(x, w, b)
    return y if b is None else y + b
