"""pdmesh as a package: what `pip install .` (not editable) gets.

- pyproject.toml declares the runtime dependencies, the same names as
  requirements-runtime.txt (the image's list; constraints.txt pins their tested versions);
  test and lint packages stay in the `dev` extra, Triton in `cuda` (and `dev`).
- The wheel carries every file the code opens beside itself at run time: the calibration
  text (SmoothQuant), the C++ CPU ops' sources, the chat templates.
- CPU serving runs without Triton: the kernels' Triton entry points then say what to
  install, and a whole generation runs on the torch / C++ paths.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def names(lines) -> set[str]:
    out = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        out.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_declares_the_runtime_requirements():
    declared = names(project()["dependencies"])
    runtime = names((ROOT / "requirements-runtime.txt").read_text().splitlines())
    assert declared == runtime | {"torch"}, (declared ^ (runtime | {"torch"}))


def test_test_lint_and_triton_packages_stay_out_of_the_runtime():
    extras = project()["optional-dependencies"]
    runtime = names(project()["dependencies"])
    dev_only = names((ROOT / "requirements.txt").read_text().splitlines())
    assert names(extras["dev"]) == dev_only
    assert not runtime & dev_only, runtime & dev_only
    assert names(extras["cuda"]) == {"triton"}


def test_the_wheel_carries_what_the_code_opens(tmp_path):
    src = tmp_path / "src"        # a copy: an in-tree build would leave build/ behind
    for top in ("pdmesh", "shared", "services", "kernels"):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(src)], check=True,
                   timeout=300)
    (whl,) = tmp_path.glob("pdmesh-*.whl")
    with zipfile.ZipFile(whl) as z:
        files = set(z.namelist())
        meta = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    for need in ("shared/engine/calibration.txt", "kernels/cpu_ops/kv_copy.cpp",
                 "pdmesh/cli.py", "services/gateway/app.py"):
        assert need in files, need
    assert any(f.startswith("kernels/cpu_ops/") and f.endswith(".cpp") for f in files)
    requires = names(line.split(":", 1)[1] for line in meta.splitlines()
                     if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert requires == names(project()["dependencies"])
    assert "pytest" not in requires and "triton" not in requires


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None          # as if not installed: any import of it fails
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
import kernels.kv_cache as kv
try:
    kv.write_kv_triton()
except RuntimeError as e:
    assert "pdmesh[cuda]" in str(e), e
else:
    raise SystemExit("a Triton entry point ran without triton")
eng = LLMEngine(EngineConfig(model=sys.argv[1], num_blocks=32, threads=1))
out = eng.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4,
                                                  ignore_eos=True))
assert len(out[0]["token_ids"]) == 4, out
print("served", out[0]["token_ids"])
"""


def test_cpu_serving_runs_without_triton(tiny_target):
    r = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(tiny_target)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "served" in r.stdout
