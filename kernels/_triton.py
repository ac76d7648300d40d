"""Shared helpers for the Triton host functions.

Why `launchable`: triton 3.x reads TRITON_INTERPRET when `@triton.jit` runs (import
time), not at launch. The engine imports `kernels` long before any test sets the
variable, so each host function asks for the kernel as the environment wants it *now*:
the decorated kernel itself, or a twin re-decorated from the same Python function.
"""
import functools

import torch
import triton
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction


def interpreting() -> bool:
    return bool(knobs.runtime.interpret)


@functools.cache
def _rejit(fn, interpret: bool):
    # triton.jit consults knobs.runtime.interpret itself; `interpret` only keys the cache
    return triton.jit(fn)


def launchable(kernel):
    """`kernel` (a @triton.jit function) honouring TRITON_INTERPRET as set now."""
    want = interpreting()
    if isinstance(kernel, InterpretedFunction) == want:
        return kernel
    return _rejit(kernel.fn, want)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device: CUDA, or CPU while the Triton interpreter is on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: tensors are on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{op}: tensors are on {device}; the Triton path needs CUDA tensors "
                         f"(or TRITON_INTERPRET=1 to run the interpreter on CPU)")


def check_inner_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have stride 1 in its last dim, got strides {tuple(t.stride())}")
