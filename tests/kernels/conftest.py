"""Kernel tests run the Triton kernels in the CPU interpreter.

triton 3.x reads TRITON_INTERPRET when `@triton.jit` decorates a kernel; our host
functions re-read it at launch (kernels/_triton.py: `launchable`), so setting it per
test is enough and nothing leaks into the rest of the pytest process.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
