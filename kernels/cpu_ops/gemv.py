"""The C++ matmuls of a few rows (int4_gemv.cpp, int8_gemv.cpp): a decode step's, which
is bandwidth-bound and where torch's weight-only kernels reach about half of what a core
streams; and of a decode batch's rows (batch_gemm.cpp: the weight decoded once per call,
multiplied against every row). The int4 weight has its own layout (below); the int8 weight
is Int8Weight's own.

codes [N, K/2] uint8: each 64 inputs (groups 2b and 2b + 1 of 32) are 32 bytes, byte i
holding input i of the first group in its low nibble and input i of the second in its high
nibble: one zero-extension and two bit operations turn them into 64 bfloat16 words.
"""
from __future__ import annotations

import os
import threading

import torch

from kernels.cpu_ops.build import load

GROUP = 32


def gemv_ready() -> bool:
    """Whether int4_gemv runs here (built with AVX512-BF16, or AVX2 and FMA); else torch's
    int4 kernel serves the int4 weights (also with PDMESH_CPU_GEMV=0: A/B runs)."""
    mod = _mod()
    return mod is not None and mod.int4_simd()


def int8_gemv_ready() -> bool:
    """Whether int8_gemv runs here (built with AVX-512, or AVX2 and FMA); else torch's
    int8 kernel serves."""
    mod = _mod()
    return mod is not None and mod.int8_simd()


def float_gemv_ready() -> bool:
    """Whether float_gemv runs here (built with AVX2 and FMA)."""
    mod = _mod()
    return mod is not None and mod.float_simd()


def _mod():
    return None if os.environ.get("PDMESH_CPU_GEMV", "1") == "0" else load()


def batch_ready() -> bool:
    """Whether int4_gemm and int8_gemm run here (built with AVX512-BF16)."""
    mod = _mod()
    return mod is not None and mod.batch_simd()


def set_batch_helper(on: bool) -> None:
    """int4_gemv, int8_gemv, int4_gemm and int8_gemm share their work with one helper
    thread (the engine's batch_helper, helper.h): it takes work items as the OS gives it a
    core, so a busy second core costs only its wake-ups. Wherever the C++ ops run: on AVX2,
    where int4_gemm and int8_gemm are not built, int4_gemv and int8_gemv use it."""
    mod = _mod()
    if mod is not None:
        mod.set_batch_helper(on)


def batch_helper_on() -> bool:
    """Whether the matmuls share their work with the helper thread now."""
    mod = _mod()
    return mod is not None and mod.batch_helper_on()


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor) -> torch.Tensor:
    """int4_gemv's product for a decode batch (the weight decoded to int4_dequant's bfloat16
    values once, float32 sums): each row's result the same bits at any row count."""
    return load().int4_gemm(x.contiguous(), codes, scale, zero)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_gemv's product for 3 rows and more (q exact in bfloat16, float32 sums, the row's
    scale after): each row's result the same bits at any row count."""
    return load().int8_gemm(x.contiguous(), q, scale)


def float_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T for a plain float32 | bfloat16 weight, float32 sums, in x's
    dtype: each row's result the same bits at any row count (deterministic mode's matmul,
    at the cost of its own rows rather than of a padded 16-row tile)."""
    return load().float_gemv(x, w)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 | bfloat16, rounded to bfloat16 as torch's int8 kernel takes it)
    @ (q [N, K] int8 * scale [N]).T, in x's dtype."""
    return load().int8_gemv(x.contiguous(), q, scale)


def gemv_pack(q: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (0..15, K a multiple of 64) -> [N, K/2] uint8 in the kernel's order."""
    n, k = q.shape
    if k % 64:
        raise ValueError(f"int4 gemv: in_features {k} is not a multiple of 64")
    b = q.to(torch.uint8).reshape(n, k // 64, 2, 32)            # block, group, input
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def gemv_unpack(codes: torch.Tensor) -> torch.Tensor:
    """gemv_pack's inverse: [N, K/2] uint8 -> codes [N, K] int32."""
    n, half = codes.shape
    b = codes.reshape(n, half // 32, 1, 32)
    return torch.cat([b & 0xF, b >> 4], dim=2).reshape(n, half * 2).to(torch.int32)


def int4_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 | bfloat16) @ w.T, w = (q - 8) * scale + zero per group of 32
    (scale, zero bfloat16 [N, K/32]), in x's dtype."""
    return load().int4_gemv(x.contiguous(), codes, scale, zero)


def int4_gemv_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  zero: torch.Tensor) -> torch.Tensor:
    """The same product in torch: x rounded to bfloat16, the weight dequantized in float32."""
    q = gemv_unpack(codes).float()
    n, k = q.shape
    w = (q.reshape(n, k // GROUP, GROUP) - 8.0) * scale.float()[..., None] + zero.float()[..., None]
    xb = x.to(torch.bfloat16).float()
    return (xb @ w.reshape(n, k).T).to(x.dtype)


def int4_dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 into: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as bfloat16 [N, K]: (q - 8) * scale + zero in float32, rounded; written
    into the front of `into` (bfloat16, N * K elements or more) when given."""
    return load().int4_dequant(codes, scale, zero, into)


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This thread's buffer of at least numel elements of dtype, kept from call to call:
    the dequantized weight of one GEMM at a time lives there (a fresh multi-MB tensor per
    call costs its page faults again each time)."""
    name = f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


GEMV_MAX_ROWS = 8   # int4: a verify of up to 7 drafts gets a decode step's bits; more rows
#                     go to int4_gemm. SmolLM2's gate|up, one core (int4_gemv / int4_gemm /
#                     dequantize + torch's bfloat16 GEMM, us): 8 rows 365 / 257 / 370;
#                     9: 504 / 335 / 520; 16: 797 / 419 / 592; 32: 1484 / 770 / 858;
#                     64: 3034 / 1419 / 1616
GEMM_MAX_ROWS = 64  # int4: from here on (prefill) oneDNN's blocking wins
AVX2_GEMV_MAX_ROWS = 32   # int4 on AVX2 (no int4_gemm): more rows go to torch's float32
#                           GEMM on the dequantized weight. One core, AMD EPYC (int4_gemv /
#                           dequantize + float32 GEMM, ms): gate|up 16 rows 1.56 / 3.27,
#                           32: 3.33 / 5.05, 64: 8.86 / 7.31; down 16: 0.81 / 0.99,
#                           32: 1.68 / 1.51, 64: 3.38 / 2.45
INT8_GEMV_MAX_ROWS = 2   # int8 (the LM head): more rows go to int8_gemm. SmolLM2's half
#                          head, one core (int8_gemv / int8_gemm / torch's int8 kernel, us):
#                          2 rows 1737 / 2057 / 2624; 3: 3286 / 2025 / 2865; 8: 7278 /
#                          2995 / 5678; 16: 15964 / 4730 / 12710; 32: 27064 / 7291 / 21837


class Int4Packed:
    """An int4 weight in int4_gemv's layout: x @ w.T on int4_gemv up to GEMV_MAX_ROWS rows
    (small decode batches, speculative verifies: each row's result the same bits at any
    row count up to there), on int4_gemm up to GEMM_MAX_ROWS (decode batches: the same bits
    at any row count in that range), on torch's bfloat16 GEMM over the dequantized weight
    from there (prefill).
    Activations as torch's int4 kernel takes them: bfloat16 (a float32 x is rounded)."""
    __slots__ = ("codes", "scale", "zero", "bf16")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        """q [N, K] codes 0..15, scale and zero [N, K/32] (any float dtype)."""
        self.bf16 = batch_ready()   # AVX512-BF16 (int4_gemm, bfloat16 GEMMs); else AVX2
        self.codes = gemv_pack(q)
        self.scale = scale.to(torch.bfloat16).contiguous()
        self.zero = zero.to(torch.bfloat16).contiguous()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scale.numel() * self.scale.element_size()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= (GEMV_MAX_ROWS if self.bf16 else AVX2_GEMV_MAX_ROWS):
            return int4_gemv(x, self.codes, self.scale, self.zero)
        if rows <= GEMM_MAX_ROWS and self.bf16:
            return int4_gemm(x, self.codes, self.scale, self.zero)
        # AVX2: float32 (torch's bfloat16 GEMM is 7x its float32 one there; the same values)
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        n, half = self.codes.shape
        w = int4_dequant(self.codes, self.scale, self.zero, scratch(n * half * 2, dtype))
        return torch.nn.functional.linear(x.to(torch.bfloat16).to(dtype), w).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return int4_dequant(self.codes, self.scale, self.zero)
