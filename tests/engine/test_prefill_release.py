"""release() of a prefill-only request that has not finished: prefill's attempt refused or
failed while its prompt computes (services/prefill/service.py: abort, then release).

The request must leave the engine, also when the refusal lands during its forward. Before
this, release() dropped the request and freed its blocks but left the sequence scheduled:
each step computed it again for nobody, and a worker filled its batch with such sequences
until it served no job at all (the chaos run on the whole-prompt path, 1,770 requests in:
both prefill workers at ~90% CPU, decode waiting on 16 jobs)."""
from __future__ import annotations

import concurrent.futures

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

P = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine(model, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=64, threads=1, device=device))


def test_released_during_its_forward_it_leaves_once_the_forward_ends(tiny_target, tiny_prompts,
                                                                     device):
    """The owner thread (engine.py) refuses the job while the worker runs its forward:
    the refusal waits for end_step, and the forward's blocks stay its own until then."""
    eng = engine(tiny_target, device)
    free = eng.pool.num_free
    eng.add_request("job/1", tiny_prompts[0], P, prefill_only=True)
    plan = eng.begin_step()                  # its forward is about to run on the worker
    eng.abort("job/1")
    eng.release("job/1")
    assert eng.pool.num_free < free          # its blocks stay while the forward writes them
    worker = concurrent.futures.ThreadPoolExecutor(1)
    logits = worker.submit(eng.forward, plan).result(60)
    outs = eng.end_step(plan, logits)
    assert outs == []                        # no first token for a released request
    assert not eng.has_unfinished, eng.stats()
    assert eng.pool.num_free == free
    want = engine(tiny_target, device).generate([tiny_prompts[1]], P)
    assert eng.generate([tiny_prompts[1]], P) == want     # and it serves on


def test_aborted_during_a_failed_forward_it_still_leaves(tiny_target, tiny_prompts, device):
    """A forward that raises ends its step too: the commands that waited for it run."""
    eng = engine(tiny_target, device)
    free = eng.pool.num_free
    eng.add_request("job/4", tiny_prompts[0], P)
    plan = eng.begin_step()
    eng.abort("job/4")
    assert eng.end_step(plan, None, failed=True) == []
    assert not eng.has_unfinished and eng.pool.num_free == free


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
    assert eng.port.kept_blocks("job/3") and eng.pool.num_free < free     # kept for the KV send
    eng.release("job/3")
    assert not eng.has_unfinished and eng.pool.num_free == free
