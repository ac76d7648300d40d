"""head_split (shared/engine/head.py): the LM head in two halves, on two threads for steps
of 1-2 rows (unless the batch helper already spreads each half over both cores), gives exactly the logits of the whole head, and an engine with it the same
tokens."""
from __future__ import annotations

import threading

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine import head
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.head import SplitHead
from shared.engine.quant import quantize_weight


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("a8", [False, True])
def test_the_halves_give_the_whole_heads_logits(rows, a8, device):
    torch.manual_seed(0)
    w = (torch.randn(1001, 128) * 0.05).to(torch.bfloat16).to(device)   # an odd vocabulary
    q = lambda t: quantize_weight(t, "int4", head=True, a8=a8)  # noqa: E731
    whole, split = q(w), SplitHead(w, q)
    x = torch.randn(rows, 128).to(torch.bfloat16).to(device)
    assert split.shape == whole.shape and split.nbytes == whole.nbytes
    assert torch.equal(split.mm(x), whole.mm(x))
    assert torch.equal(split.dequantize(), whole.dequantize())


@pytest.mark.parametrize("batch_helper", [False, True])
def test_small_steps_read_half_the_head_on_the_helper_thread(batch_helper):
    """Without the C++ matmuls' own helper thread, steps of 1-2 rows read the second half
    on the head's thread; with it (each half already on both cores), on the engine's."""
    from kernels.cpu_ops.gemv import batch_helper_on, set_batch_helper

    w = torch.randn(64, 32).to(torch.bfloat16)
    split = SplitHead(w, lambda t: quantize_weight(t, "int8", head=True))
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def raw_mm(self, x):
            seen.append((threading.current_thread().name.startswith("head"), x.shape[0]))
            return self.inner.raw_mm(x)
    split.halves = (split.halves[0], Spy(split.halves[1]))
    was = batch_helper_on()
    set_batch_helper(batch_helper)
    try:
        if batch_helper and not batch_helper_on():
            pytest.skip("the C++ ops are not built here: no batch helper")
        for rows in (1, head.PARALLEL_ROWS, head.PARALLEL_ROWS + 1):
            split.mm(torch.randn(rows, 32).to(torch.bfloat16))
    finally:
        set_batch_helper(was)
    pooled = not batch_helper
    assert seen == [(pooled, 1), (pooled, head.PARALLEL_ROWS), (False, head.PARALLEL_ROWS + 1)]


def test_an_engine_with_a_split_head_writes_the_same_tokens(tiny_target, tiny_prompts, device):
    base = dict(model=str(tiny_target), num_blocks=256, max_num_seqs=4, threads=1,
                device=device, quantize="int8")
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole, split = LLMEngine(EngineConfig(**base)), LLMEngine(EngineConfig(**base, head_split=True))
    assert isinstance(split.model.lm_head, SplitHead)
    for prompt in tiny_prompts[:3]:                   # one at a time: 1-row decode steps
        assert (split.generate([prompt], p)[0]["token_ids"]
                == whole.generate([prompt], p)[0]["token_ids"])
