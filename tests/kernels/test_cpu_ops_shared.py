"""The C++ CPU ops built once are loaded by every copy of the same source: an installed
package beside the checkout (tests/e2e/test_install.py does this) shares the build folder,
keyed by the source's digest, instead of recompiling it (~30 s), after which the checkout's
next process recompiled it again: each copy's paths differed from those the build was
made from."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kernels.cpu_ops import build

LOAD = """
from kernels.cpu_ops import build
print(build.build_dir().name, build.load() is not None)
"""


def test_a_copy_of_the_sources_elsewhere_loads_the_build_without_compiling(tmp_path):
    if build.load() is None:
        pytest.fail("the C++ CPU ops did not build (make venv builds them; see the log)")
    real = build.build_dir()
    ext = tmp_path / "ext"
    shutil.copytree(real, ext / real.name, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    so = next((ext / real.name).glob("pdmesh_cpu_ops*.so")).stat()
    src = tmp_path / "src"                         # the same source at another path
    shutil.copytree(build.HERE.parents[1] / "kernels", src / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # no compiler: a recompile fails, and load() returns None (the torch path)
    env = {**os.environ, "PDMESH_EXT_DIR": str(ext), "CXX": "/bin/false",
           "PYTHONPATH": str(src)}
    r = subprocess.run([sys.executable, "-c", LOAD], cwd=src, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [real.name, "True"], r.stdout + r.stderr[-2000:]
    after = next((ext / real.name).glob("pdmesh_cpu_ops*.so")).stat()
    assert (after.st_ino, after.st_mtime_ns) == (so.st_ino, so.st_mtime_ns)   # not relinked
