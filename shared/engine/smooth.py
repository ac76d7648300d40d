"""SmoothQuant (Xiao et al., 2023) for the two projections whose inputs carry outlier
channels: q|k|v (after input_layernorm) and down (after silu(gate) * up).

act_int8 leaves these two on the weight-only kernels, because per-row int8 activations
lose the few large channels (SmolLM2 int4, prose perplexity +0.37 and +0.22). Those
kernels are compute-bound with bf16 activations on a CPU without AVX512-BF16: at 16
decode rows q|k|v and down take ~30% of a step, and W8A8 multiplies them 3.5x faster.
SmoothQuant moves the outliers into the weight: per input channel j,

    s_j = max|x_j| ** alpha / max|W_:,j| ** (1 - alpha),   x @ W.T = (x / s) @ (W * s).T

so x / s quantizes per row without losing them. max|x_j| comes from one forward at load
over a fixed text (calibration.txt: a chat turn, Python reference prose, stdlib code;
none of it is in bench_quant.py's held-out texts). Each s_j is rounded to a power of two:
scaling by it is exact in floating point, and two processes whose calibration forwards
differ in the last bits (thread count) still get the same weights.

Only forwards of A8_MIN_ROWS rows or more take this path; a batch-1 decode step keeps
the weight-only int4/int8 weight, exactly as before.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .quant import A8_MIN_ROWS, Int8Weight

ALPHA = 0.5
CALIBRATION_TOKENS = 512          # per forward (the text is ~1,100 SmolLM2 tokens)


def calibration_text() -> str:
    return (Path(__file__).with_name("calibration.txt")).read_text()


def applies(cfg) -> bool:
    """SmoothQuant applies: act_int8's CPU path, with q|k|v and down."""
    return cfg.smoothquant and cfg.device == "cpu"


def calibration_ids(cfg, tokenizer) -> list[int] | None:
    """The calibration text's token ids when smoothing applies, else None."""
    if not applies(cfg):
        return None
    if tokenizer is None:
        raise ValueError("smoothquant calibrates on text: it needs the model's tokenizer")
    return tokenizer.encode(calibration_text())


class Observed:
    """A weight during calibration: multiplies as `base` and keeps the running per-input-
    channel max|x| of what it was given."""
    __slots__ = ("base", "amax")

    def __init__(self, base):
        self.base = base
        self.amax = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().float().abs().amax(dim=0)
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        return self.base.mm(x)


def smoothing(w: torch.Tensor, amax: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [in_features] float32, powers of two."""
    aw = w.float().abs().amax(dim=0).clamp(min=1e-5)
    s = amax.float().clamp(min=1e-5) ** alpha / aw ** (1.0 - alpha)
    return torch.exp2(torch.round(torch.log2(s.clamp(min=1e-3, max=1e3))))


class SmoothedWeight:
    """`base` (the weight-only int4/int8 weight) for forwards of fewer than A8_MIN_ROWS
    rows; W8A8 on (x / s) and W * s for larger ones."""
    __slots__ = ("base", "i8", "inv")

    def __init__(self, base, w: torch.Tensor, s: torch.Tensor):
        self.base = base
        self.i8 = Int8Weight((w.float() * s).to(w.dtype), a8=True)
        self.inv = (1.0 / s).to(w.dtype if w.dtype != torch.float32 else torch.bfloat16)

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= A8_MIN_ROWS and not x.is_cuda:
            return self.i8.mm_a8(x, self.inv)
        return self.base.mm(x)

    def dequantize(self) -> torch.Tensor:
        return self.base.dequantize()
