"""Shared helpers for the Triton host functions.

Why `launchable`: triton 3.x reads TRITON_INTERPRET when `@triton.jit` decorates a
function, i.e. at import time -- ours and triton.language's own @jit helpers (tl.sum,
tl.max, tl.cdiv, tl.zeros, ...). The engine imports `kernels` long before a test sets the
variable, so host functions launch through `launchable(kernel)`, which honours the
variable as it is *now*: compiled kernels normally; under TRITON_INTERPRET=1 an
interpreted twin of the kernel, launched while triton.language's compiled helpers are
swapped for interpreted twins (the interpreter patches the builtins the same way).
"""
import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# namespaces whose @jit helpers a kernel may reach (tl.sum, x.sum(), tl.standard._sum_combine, ...)
_STDLIB_NAMESPACES = (tl, tl.standard, tl.random, tl.math, tl.core.tensor)


def interpreting() -> bool:
    return bool(knobs.runtime.interpret)


@functools.cache
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


@contextlib.contextmanager
def _interpreted_stdlib():
    # one twin per function, so `tl.sum is tl.standard.sum` still holds while patched
    saved = [(ns, name, obj) for ns in _STDLIB_NAMESPACES for name, obj in list(vars(ns).items())
             if isinstance(obj, JITFunction)]
    try:
        for ns, name, obj in saved:
            setattr(ns, name, _interpreted(obj.fn))
        yield
    finally:
        for ns, name, obj in saved:
            setattr(ns, name, obj)


class _InterpretedLaunch:
    def __init__(self, kernel: InterpretedFunction):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpreted_stdlib():
                return self.kernel[grid](*args, **kwargs)
        return launch


def launchable(kernel):
    """`kernel` (a @triton.jit function) as TRITON_INTERPRET wants it now; index with the grid.

    One way only: a process that imported triton with TRITON_INTERPRET=1 stays interpreted.
    """
    if not interpreting():
        return kernel
    if isinstance(kernel, JITFunction):
        kernel = _interpreted(kernel.fn)
    return _InterpretedLaunch(kernel)


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
            raise ValueError(f"{op}: {name} must have stride 1 in its last dim, got strides "
                             f"{tuple(t.stride())}")
