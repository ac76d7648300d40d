"""Fixtures of the in-process decode/prefill tests (local_mesh.py)."""
from __future__ import annotations

import pytest

from .local_mesh import DET, MAX_TOKENS


@pytest.fixture(scope="module")
def reference(tiny_target):
    """prompt -> the engine alone's greedy tokens (deterministic mode, MAX_TOKENS)."""
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=64, **DET))
    sp = SamplingParams(temperature=0.0, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda p: eng.generate([p], sp)[0]["token_ids"]
