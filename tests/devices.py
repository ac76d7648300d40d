"""The device a test runs on (issue 14): a test that builds an engine or runs a kernel takes
the `device` fixture and runs once per device, "cpu" always and "cuda" where torch sees a GPU.
Without one the cuda case is skipped by its mark, before any fixture is set up, so nothing is
built for it. Module scope: a module's own fixtures (an engine, a reference run) may take it.
tests/engine/conftest.py and tests/kernels/conftest.py re-export it. On a machine with a GPU,
`pytest -k cuda tests/engine tests/kernels` runs the cuda cases (scripts/device_check.sh
runs those of the device files).

Pass it on: EngineConfig(device=device) and the tensors a test makes (`.to(device)`); the
engine hands logits back on the host (model.py), so tokens compare as they are."""
import pytest
import torch

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param
