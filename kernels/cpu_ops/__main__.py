"""`python -m kernels.cpu_ops`: build the C++ CPU ops now (make venv does)."""
import logging
import sys

from kernels.cpu_ops.build import build_dir, load

logging.basicConfig(level=logging.INFO, format="[cpu_ops] %(message)s")
mod = load()
print(f"[cpu_ops] {'ready in ' + str(build_dir()) if mod else 'not built: the torch path serves'}")
sys.exit(0)
