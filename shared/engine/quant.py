"""Weight-only quantization of the linear layers, in the style of gpt-fast.

  int8   per output channel, symmetric: w ~= q * scale, q in [-127, 127]; the matmul is
         kernels/cpu_ops/int8_gemv.cpp up to 2 rows on an AVX-512 CPU (the LM head of a
         decode step at 1.3-1.4x), batch_gemm.cpp's int8_gemm from 3 rows with AVX512-BF16
         (a decode batch's head: 2.7x at 16 rows); on a CPU with AVX2 alone int8_gemv at
         every row count (SmolLM2's head 2.2x at 1 row, 1.2-1.8x at 4-16:
         docs/bench/cpu_gemv_avx2.json); torch's `_weight_int8pack_mm` otherwise
         (activations stay in the model dtype).
  int4   groups of `group_size` input channels (32, as the GGUF's Q4_1), asymmetric:
         w ~= (q - 8) * scale + zero, q in [0, 15]; on a CPU with AVX512-BF16,
         kernels/cpu_ops/int4_gemv.cpp for up to 8 rows (a decode step at 1.4-1.7x torch's
         int4 kernel: the batch-1 matmul is bandwidth-bound), batch_gemm.cpp's int4_gemm
         for 9-64 rows (a decode batch: 1.4x the dequantize + GEMM below at 16 rows) and
         torch's bfloat16 GEMM on the dequantized weight from there (prefill); with AVX2
         alone int4_gemv up to 32 rows and torch's float32 GEMM on the dequantized weight
         from there (1.3-1.6x torch's int4 kernel at 1-64 rows, 2.1x at 256);
         elsewhere torch's
         `_weight_int4pack_mm_for_cpu` (`_weight_int4pack_mm` on CUDA). Q4_1 stores
         w = q * d + m per group of 32, which is this grid with scale = d, zero = m + 8d;
         Q4_0 stores w = (q - 8) d, the grid with zero = 0. Each group takes whichever of
         the two fits it better (int4_codes), so re-quantizing weights converted from a
         Q4_0 or Q4_1 GGUF recovers llama.cpp's own weights (up to bf16 rounding of the
         scales). The LM head stays int8 in this mode, as the GGUF keeps token_embd in Q8_0.

torch's CPU kernels are vectorized for bfloat16 activations, not float32 (30-100x slower):
a float32 model's quantized matmuls take bfloat16 activations and scales, the result goes
back to float32.

A quantized weight is an object with `mm(x) -> x @ w.T` (`linear` in model.py calls it),
`nbytes` (what one decode step reads) and `dequantize()` (tests, accuracy checks).
Embedding lookups keep the unquantized table (one row per token is read).
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from kernels.cpu_ops import dequant_rows, quant_rows
from kernels.cpu_ops.gemv import (
    INT8_GEMV_MAX_ROWS,
    Int4Packed,
    batch_ready,
    gemv_ready,
    int8_gemm,
    int8_gemv,
    int8_gemv_ready,
)

log = logging.getLogger("pdmesh.engine")
MODES = ("", "int8", "int4")
A8_MIN_ROWS = 6        # act_int8: forwards of at least this many rows take int8 activations
#                        (measured on SmolLM2, one thread: int4 at 4 rows is 9% faster than W8A8,
#                        W8A8 at 8 rows 31% faster than int4)
INT4_GROUP = 32


class Int8Weight:
    """a8: a forward of A8_MIN_ROWS rows or more quantizes its activations to int8 (per row,
    symmetric) and multiplies on int8 dot products (oneDNN, VNNI; int_mm elsewhere), 5-10x
    the bfloat16-activation kernel's throughput from 32 rows on; fewer rows (a batch-1
    decode step, bandwidth-bound) keep that kernel. Deterministic mode pads every forward
    to a fixed number of rows, so its numerics still do not depend on the batch."""
    __slots__ = ("q", "scale", "scale_f", "a8", "packed", "_ones", "_zps", "gemv", "batch",
                 "head")

    def __init__(self, w: torch.Tensor, a8: bool = False, head: bool = False):
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(_act(w.dtype, w.is_cuda))
        self.a8 = a8 and not w.is_cuda
        self.gemv = not w.is_cuda and int8_gemv_ready()   # up to INT8_GEMV_MAX_ROWS rows
        self.batch = not w.is_cuda and w.shape[1] % 32 == 0 and batch_ready()   # then int8_gemm
        # the LM head: float32 logits, the top ones computed in float32 (refine_top)
        self.head = head and not w.is_cuda
        self.scale_f = scale if self.a8 or self.head else None
        self.packed = _prepack(self.q) if self.a8 else None
        if self.packed is not None:   # the GEMM's own scales stay 1: its float32 output is
            n = self.q.shape[0]       # the exact int32 sum, scaled after as before
            self._ones, self._zps = torch.ones(n), torch.zeros(n, dtype=torch.long)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        out = self.raw_mm(x)
        return refine_top(out.float(), x, self.rows) if self.head else out

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The weight's rows idx (any shape) in float32: [*idx.shape, in_features]."""
        return self.q[idx].float() * self.scale_f[idx].unsqueeze(-1)

    def raw_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T in the kernels' own precision (a head's: before refine_top)."""
        if x.is_cuda:  # no fused kernel relied on: dequantize on the fly (unverified path)
            return F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        if self.a8 and x.shape[0] >= A8_MIN_ROWS:
            return self.mm_a8(x)
        # no int8_gemm (AVX2 builds): int8_gemv at any row count (1.2-2.2x torch's kernel
        # at 1-16 rows; one kernel, so a row's bits at any batch)
        if self.gemv and (x.shape[0] <= INT8_GEMV_MAX_ROWS or not self.batch):
            return int8_gemv(x, self.q, self.scale)
        if self.batch:
            return int8_gemm(x, self.q, self.scale)
        return torch.ops.aten._weight_int8pack_mm(x.to(self.scale.dtype), self.q,
                                                  self.scale).to(x.dtype)

    def mm_a8(self, x: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
        """(x * inv) @ w.T on int8 activations (per-row scales): one pass to quantize, the
        int8 GEMM, one pass to scale back (kernels/cpu_ops: C++ when built, else torch;
        the same bits either way)."""
        if self.packed is None:
            xq, sx = quant_rows(x, inv)
            return dequant_rows(int_mm(xq, self.q), sx, self.scale_f, x.dtype)
        xu, sx = quant_rows(x, inv, u8=True)
        acc = _qlinear(xu, self.packed, self._ones, self._zps)
        return dequant_rows(acc, sx, self.scale_f, x.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(self.scale.dtype)


REFINE_TOP = 16


def refine_top(out: torch.Tensor, x: torch.Tensor, rows, k: int = REFINE_TOP) -> torch.Tensor:
    """The LM head's logits out (float32, [M, V]), each row's k largest computed again in
    float32 from the int8 weight (rows(idx): its rows idx in float32), in place.

    A bfloat16 model's head, and a float32 one's on torch's int8 kernel (bfloat16
    activations, no AVX-512), gives logits in steps of 0.125 at 16-32, and the greedy token
    was chosen between rounded values, ties included: SmolLM2's first answer token, "The"
    at 25.54 and "L" at 25.35, both came out 25.375 in the mesh, and the tie went to "L"
    ("L'Étoile..." instead of "Paris"). The candidates are picked on the rounded values
    (what rounding moves stays far within the 16th); each is a sum over the hidden size
    alone, whatever the batch."""
    idx = out.topk(min(k, out.shape[-1]), dim=-1).indices                     # [M, k]
    return out.scatter_(-1, idx, (rows(idx) * x.float().unsqueeze(1)).sum(-1))


def _prepack(q: torch.Tensor):
    """q [n, k] int8 in oneDNN's own blocked layout for its u8s8 qlinear (VNNI / AMX), or
    None where this torch has no oneDNN qlinear. torch._int_mm takes the plain layout and
    re-blocks the weight on every call: with the weights out of cache, the prepacked GEMM
    of SmolLM2's gate|up at 16 rows is 166 us against 325 (same int32 sums).
    PDMESH_NO_PREPACK=1 keeps _int_mm (A/B runs)."""
    if os.environ.get("PDMESH_NO_PREPACK") == "1" or not qlinear_exact():
        return None
    return _qlinear_prepack(q)


def _qlinear_prepack(q: torch.Tensor):
    try:
        return torch.ops.onednn.qlinear_prepack(q, [A8_MIN_ROWS * 4, q.shape[1]])
    except (RuntimeError, AttributeError):
        return None


def _qlinear(xu: torch.Tensor, packed, ones: torch.Tensor, zps: torch.Tensor) -> torch.Tensor:
    """The u8s8 GEMM's int32 sums as float32 (weight scales `ones`, zero point 128)."""
    return torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, ones, zps, None, 1.0, 0,
                                              torch.float32, "none", [], "")


@functools.cache
def qlinear_exact() -> bool:
    """Whether oneDNN's prepacked u8s8 qlinear sums exactly here. With VNNI or AMX it does;
    on AVX2 alone (an AMD EPYC, seen here) it multiplies with vpmaddubsw, whose pairs of
    u8 x s8 products saturate at int16: sums off by up to 16,408 in 64 products, and the
    W8A8 model's output garbage. Decided once per process on the worst case (activations
    255, weights 127); where it fails, int_mm's float32 GEMMs serve (exact, slower than
    the weight-only kernels)."""
    k, n = 64, 8
    packed = _qlinear_prepack(torch.full((n, k), 127, dtype=torch.int8))
    if packed is None:
        return False
    xu = torch.full((A8_MIN_ROWS, k), 255, dtype=torch.uint8)
    sums = _qlinear(xu, packed, torch.ones(n), torch.zeros(n, dtype=torch.long))
    exact = torch.equal(sums, torch.full((A8_MIN_ROWS, n), 127.0 * 127 * k))
    if not exact:
        log.warning("this CPU's oneDNN int8 GEMM saturates (no VNNI/AMX): W8A8 (act_int8) "
                    "runs on float32 GEMMs, exact but slower than the weight-only kernels")
    return exact


EXACT_K = 1024    # 127 * 127 * 1024 < 2**24: a float32 sum of that many products is exact


def int_mm(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """xq [M, K] @ q [N, K].T, int8 -> the exact int32 sums. torch._int_mm where oneDNN has
    int8 dot products (VNNI); elsewhere it is a slow loop, and float32 GEMMs over
    EXACT_K-wide slices, each exact whatever the order of its additions, give the same sums
    (AVX2, one thread: SmolLM2's down at 512 rows 15 ms against 454; gate|up at 16 rows 25
    against 28, converting the weight dominates)."""
    if qlinear_exact():
        return torch._int_mm(xq, q.T)
    acc = None
    for k0 in range(0, xq.shape[1], EXACT_K):
        part = (xq[:, k0:k0 + EXACT_K].float() @ q[:, k0:k0 + EXACT_K].float().T).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def int4_codes(w: torch.Tensor, group: int = INT4_GROUP):
    """(q [n, k] int32 in 0..15, scale, zero [n, k/group, 1] float32): w ~= (q - 8) scale
    + zero per group of `group` input channels. Each group takes the better (by its squared
    error) of two grids: min to max in 15 steps (llama.cpp's Q4_1), or symmetric with the
    value of largest magnitude at -8 steps (Q4_0: scale = -that / 8, zero 0). Weights read
    from a Q4_0 or Q4_1 GGUF lie on one of them, so their codes come back exactly."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group {group}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15.0
    q = torch.round((g - lo) / scale).clamp_(0, 15)
    zero = lo + 8.0 * scale
    ext = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))
    d = torch.where(ext.abs() < 1e-12, torch.ones_like(ext), -ext / 8.0)
    q0 = torch.floor(g / d + 8.5).clamp_(0, 15)          # llama.cpp's rounding (+8.5, floor)
    err = ((q - 8.0) * scale + zero - g).square().sum(dim=-1, keepdim=True)
    err0 = ((q0 - 8.0) * d - g).square().sum(dim=-1, keepdim=True)
    sym = err0 < err
    q = torch.where(sym, q0, q).to(torch.int32).reshape(n, k)
    return q, torch.where(sym, d, scale), torch.where(sym, torch.zeros_like(zero), zero)


class Int4Weight:
    __slots__ = ("packed", "scales_zeros", "group", "out_features", "in_features", "_dq", "i8",
                 "gemv")

    def __init__(self, w: torch.Tensor, group: int = INT4_GROUP, inner_k_tiles: int = 1,
                 a8: bool = False):
        """a8: forwards of A8_MIN_ROWS rows or more use an int8 copy of w on int8 activations
        (Int8Weight(a8=True)); a batch-1 decode step reads the int4 weight."""
        n, k = w.shape
        self.i8 = Int8Weight(w, a8=True) if a8 and not w.is_cuda else None
        q, scale, zero = int4_codes(w, group)
        self.group, self.out_features, self.in_features = group, n, k
        self._dq, self.gemv = None, None
        if (not w.is_cuda and w.dtype in (torch.float32, torch.bfloat16) and group == 32
                and k % 64 == 0 and gemv_ready()):   # the C++ kernel's own layout
            self.gemv = Int4Packed(q, scale[..., 0], zero[..., 0])
            self.packed = self.scales_zeros = None
            return
        sz = torch.cat([scale, zero], dim=-1)                     # [n, k/g, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(_act(w.dtype, w.is_cuda))
        if w.is_cuda:   # the CUDA packing (unverified); dequantized fallback if missing
            try:
                qu8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(qu8, 8)
            except (RuntimeError, AttributeError):
                self.packed, self._dq = None, self._dequant(q, w.dtype)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)

    def _dequant(self, q: torch.Tensor, dtype) -> torch.Tensor:
        sz = self.scales_zeros.float().transpose(0, 1)            # [n, k/g, 2]
        g = q.float().reshape(self.out_features, -1, self.group)
        w = (g - 8.0) * sz[..., :1] + sz[..., 1:]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        if self.gemv is not None:
            return self.gemv.nbytes
        if self._dq is not None:
            return self._dq.numel() * self._dq.element_size()
        return (self.out_features * self.in_features) // 2 + (
            self.scales_zeros.numel() * self.scales_zeros.element_size())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._dq is not None:
            return F.linear(x, self._dq)
        if self.i8 is not None and x.shape[0] >= A8_MIN_ROWS:
            return self.i8.mm(x)
        if self.gemv is not None:
            return self.gemv.mm(x)
        return self._mm4(x)

    def _mm4(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T on the int4 weight."""
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group,
                                                      self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.scales_zeros.dtype), self.packed, self.group, self.scales_zeros).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        if self.gemv is not None:
            return self.gemv.dequantize()
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype,
                        device=self.scales_zeros.device)
        return self._mm4(eye).T.contiguous()


def _act(dtype: torch.dtype, cuda: bool) -> torch.dtype:
    """The activation dtype of the CPU kernels for a model of `dtype`."""
    return torch.bfloat16 if dtype == torch.float32 and not cuda else dtype


def quantize_weight(w: torch.Tensor, mode: str, head: bool = False, a8: bool = False):
    """The weight in `mode` ('' keeps it). The LM head (head=True) is int8 under int4.
    a8: batches on int8 activations (Int8Weight)."""
    if mode == "":
        return w
    if mode == "int8" or head:
        return Int8Weight(w, a8=a8, head=head)
    if mode == "int4":
        return (Int4Weight(w, a8=a8) if w.shape[1] % INT4_GROUP == 0
                else Int8Weight(w, a8=a8))
    raise ValueError(f"quantize must be one of {MODES}, got {mode!r}")


def weight_nbytes(w) -> int:
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes
