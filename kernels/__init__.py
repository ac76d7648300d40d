"""pdmesh's kernels: Triton paged attention and KV write (kv_cache, paged_attention), C++ CPU ops.

`kernels` is also the import name of Hugging Face's `kernels` package, which transformers >= 5.25
requires and imports while loading any model config. With both installed, transformers finds this
package instead and fails on `from kernels import CUDAProperties` deep inside a model load; say
what is wrong instead. requirements.txt keeps transformers below 5.25 and constraints.txt pins it.
"""

from importlib import metadata as _metadata

try:
    _hf = _metadata.version("kernels")
except _metadata.PackageNotFoundError:
    _hf = None
if _hf is not None:
    raise ImportError(
        f"Hugging Face's 'kernels' package {_hf} is installed, and its import name is pdmesh's "
        "kernels/ (transformers >= 5.25 pulls it in). Install with make venv "
        "(pip install -c constraints.txt -r requirements.txt), or pip uninstall kernels.")
