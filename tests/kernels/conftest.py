"""Kernel tests run the Triton kernels in the CPU interpreter on "cpu", compiled on "cuda".

triton 3.x reads TRITON_INTERPRET when `@triton.jit` decorates a kernel; our host
functions re-read it at launch (kernels/_triton.py: `launchable`), so setting it per
test is enough and nothing leaks into the rest of the pytest process. A test that takes
`device` (tests/devices.py) on "cuda" launches the real kernels: the variable is unset.
"""
import pytest
import torch

from tests.devices import device  # noqa: F401  (the shared fixture)


@pytest.fixture(autouse=True)
def triton_interpreter(request, monkeypatch):
    if "device" in request.fixturenames and request.getfixturevalue("device") != "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
