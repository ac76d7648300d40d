"""Engine tests that build an engine or make tensors take `device` (tests/devices.py)."""
from tests.devices import device  # noqa: F401  (the shared fixture)
