"""release() of a prefill-only request that has not finished: prefill's attempt refused or
failed while its prompt computes (services/prefill/service.py: abort, then release).

The request must leave the engine, also when the refusal lands during its forward. Before
this, release() dropped the request and freed its blocks but left the sequence scheduled:
each step computed it again for nobody, and a worker filled its batch with such sequences
until it served no job at all (the chaos run on the whole-prompt path, 1,770 requests in:
both prefill workers at ~90% CPU, decode waiting on 16 jobs)."""
from __future__ import annotations

import threading

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

P = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine(model, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=64, threads=1, device=device))


def test_released_during_its_forward_it_leaves_once_the_forward_ends(tiny_target, tiny_prompts,
                                                                     device):
    eng = engine(tiny_target, device)
    free = eng.pool.num_free
    entered, go, outs = threading.Event(), threading.Event(), []
    forward = eng.model.forward

    def slow(*a, **kw):
        entered.set()
        assert go.wait(30)
        return forward(*a, **kw)
    eng.model.forward = slow
    eng.add_request("job/1", tiny_prompts[0], P, prefill_only=True)
    step = threading.Thread(target=lambda: outs.append(eng.step()))
    step.start()
    assert entered.wait(30)                  # its forward runs: the refusal lands now
    eng.abort("job/1")
    eng.release("job/1")
    assert eng.pool.num_free < free          # its blocks stay while the forward writes them
    go.set()
    step.join(30)
    eng.model.forward = forward
    assert outs == [[]]                      # no first token for a released request
    assert not eng.has_unfinished, eng.stats()
    assert eng.pool.num_free == free
    want = engine(tiny_target, device).generate([tiny_prompts[1]], P)
    assert eng.generate([tiny_prompts[1]], P) == want     # and it serves on


def test_released_before_it_was_scheduled_it_leaves_at_once(tiny_target, tiny_prompts, device):
    eng = engine(tiny_target, device)
    free = eng.pool.num_free
    eng.add_request("job/2", tiny_prompts[0], P, prefill_only=True)
    eng.release("job/2")
    assert not eng.has_unfinished and eng.step() == [] and eng.pool.num_free == free


def test_released_after_its_prefill_it_frees_the_kept_blocks(tiny_target, tiny_prompts, device):
    eng = engine(tiny_target, device)
    free = eng.pool.num_free
    eng.add_request("job/3", tiny_prompts[0], P, prefill_only=True)
    (out,) = eng.step()
    assert out.finished and len(out.new_token_ids) == 1
    assert eng.kept_blocks("job/3") and eng.pool.num_free < free     # kept for the KV send
    eng.release("job/3")
    assert not eng.has_unfinished and eng.pool.num_free == free
