"""Hugging Face's `kernels` package shares this repo's kernels/ import name: a fresh install that
pulls it in (transformers >= 5.25) must fail with a message saying so, not deep in a model load."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_kernels(extra_path: Path | None) -> subprocess.CompletedProcess:
    code = "import sys; sys.path.append(sys.argv[1]) if sys.argv[1] else None; import kernels"
    return subprocess.run([sys.executable, "-c", code, str(extra_path or "")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_kernels_imports_when_the_hub_package_is_absent():
    r = _import_kernels(None)
    assert r.returncode == 0, r.stderr


def test_the_hub_kernels_package_installed_beside_it_is_named_in_the_error(tmp_path):
    dist = tmp_path / "kernels-0.19.1.dist-info"   # what pip leaves for `pip install kernels`
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    r = _import_kernels(tmp_path)
    assert r.returncode != 0
    assert "Hugging Face's 'kernels' package 0.19.1 is installed" in r.stderr
    assert "constraints.txt" in r.stderr


def test_requirements_keep_transformers_below_the_release_that_needs_it():
    reqs = (ROOT / "requirements-runtime.txt").read_text()
    pins = (ROOT / "constraints.txt").read_text()
    assert "transformers>=5,<5.25" in reqs
    assert "\nkernels==" not in pins
    version = next(line.split("==")[1] for line in pins.splitlines()
                   if line.startswith("transformers=="))
    assert tuple(int(x) for x in version.split(".")[:2]) < (5, 25)
