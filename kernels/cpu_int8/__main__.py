"""`python -m kernels.cpu_int8`: build the C++ CPU ops now (make venv does)."""
import logging
import sys

from kernels.cpu_int8.build import build_dir, load

logging.basicConfig(level=logging.INFO, format="[cpu_int8] %(message)s")
mod = load()
print(f"[cpu_int8] {'ready in ' + str(build_dir()) if mod else 'not built: the torch path serves'}")
sys.exit(0)
