"""Triton is optional: the CUDA kernels need it (the `cuda` extra), CPU serving does not
(it runs the torch references and the C++ CPU ops). Without it, a Triton entry point is a
function that says what to install."""
from __future__ import annotations


def needs_triton(err: ImportError):
    def missing(*_a, **_kw):
        raise RuntimeError(f"the Triton kernels need triton (pip install 'pdmesh[cuda]'): "
                           f"{err}") from err
    return missing
