"""A process killed while loading the C++ CPU ops (a SIGKILLed service, a timed-out install)
leaves torch's lock file in the build folder. The next process still loads them, instead of
waiting on that file forever (a CI run once hung 90 minutes in `make venv` on one)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kernels.cpu_ops import build

HOLDER = """
import time
from torch.utils.file_baton import FileBaton
from kernels.cpu_ops.build import build_dir, build_lock
with build_lock(build_dir()):
    assert FileBaton(str(build_dir() / "lock")).try_acquire()   # what cpp_extension takes
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_left_by_a_killed_loader_does_not_stop_the_next(tmp_path):
    if build.load() is None:
        pytest.fail("the C++ CPU ops did not build (make venv builds them; see the log)")
    real = build.build_dir()
    out = tmp_path / real.name                        # the same build, in a folder of its own
    shutil.copytree(real, out, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    env = {**os.environ, "PDMESH_EXT_DIR": str(tmp_path)}

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
    finally:
        holder.kill()
        holder.wait()
    assert (out / "lock").exists()                    # left behind, as after a SIGKILL

    r = subprocess.run([sys.executable, "-m", "kernels.cpu_ops"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"ready in {out}" in r.stdout
    assert "removing" in r.stderr and not (out / "lock").exists()
