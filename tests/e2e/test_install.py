"""pdmesh installed as a user installs a package: a fresh venv, the CPU torch wheel, then
`pip install .` (not editable, pinned by constraints.txt) from a copy of the source, and
that venv's `pdmesh up` serves a completion from a directory outside the checkout (every
import comes from the installed package, every file it opens came in the wheel)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_GB = 6      # the venv is ~2.3 GB (torch, triton); the rest of the suite needs room too


def test_pip_install_dot_into_a_fresh_venv_then_pdmesh_up_serves(tmp_path):
    free_gb = shutil.disk_usage(tmp_path).free / 2**30
    if free_gb < NEEDS_GB:        # a full disk would fail every test after this one
        pytest.skip(f"{free_gb:.1f} GB free under {tmp_path}, the install needs {NEEDS_GB}")
    try:
        _install_and_serve(tmp_path)
    finally:
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)


def _install_and_serve(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # --no-compile: the same files installed, without byte-compiling every module of torch
    # and transformers up front (30 of torch + transformers' 52 s here); pdmesh up
    # compiles what it imports as it imports it
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
           "-c", str(ROOT / "constraints.txt")]
    subprocess.run(pip + ["torch==2.13.0"], check=True, timeout=1200)
    src = tmp_path / "src"
    for top in ("pdmesh", "shared", "services", "kernels"):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    subprocess.run(pip + [str(src)], check=True, timeout=1200)
    shutil.rmtree(src)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PDMESH_RUN_DIR": str(tmp_path / "run"), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import pdmesh, shared; "
                            "print(pdmesh.__file__, shared.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert str(ROOT) not in where and "site-packages" in where, where
    up = subprocess.Popen([str(venv / "bin" / "pdmesh"), "up", "--model",
                           str(ROOT / "models" / "tiny-target"), "--port", "0"], cwd=tmp_path,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("pdmesh is up:"):
                break
        else:
            raise AssertionError("pdmesh up exited:\n" + "".join(lines[-40:]))
        url = line.split()[3]
        body = {"model": "tiny-target", "prompt": "def add(a, b):", "max_tokens": 8,
                "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 8, out
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
