"""Continuous batching: requests that join and leave between steps produce exactly what
they produce alone (deterministic mode), greedy and seeded-sampled."""
from __future__ import annotations

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine


def det_engine(model, device: str, **kw) -> LLMEngine:
    cfg = dict(model=str(model), num_blocks=512, block_size=16, deterministic=True,
               max_num_seqs=16, max_num_batched_tokens=128, chunk_size=32, device=device)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def params_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i,
                          max_tokens=8 + 3 * i, ignore_eos=True)


def staggered(eng: LLMEngine, prompts: list[list[int]], params=params_for,
              field: str = "new_token_ids") -> list[list]:
    """Each prompt's tokens (or another list field of its outputs), a new request joining
    every other step while others are mid-decode (request i with params(i))."""
    got = {f"r{i}": [] for i in range(len(prompts))}
    step, pending = 0, list(range(len(prompts)))
    while pending or eng.has_unfinished:
        if pending and step % 2 == 0:
            i = pending.pop(0)
            eng.add_request(f"r{i}", prompts[i], params(i))
        for o in eng.step():
            got[o.request_id] += getattr(o, field)
        step += 1
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_sixteen_staggered_requests_equal_alone(tiny_target, tiny_prompts, device):
    prompts = [tiny_prompts[i] * (1 + i % 4) for i in range(16)]  # mixed lengths
    alone = det_engine(tiny_target, device)
    want = [alone.generate([p], params_for(i))[0]["token_ids"] for i, p in enumerate(prompts)]

    eng = det_engine(tiny_target, device)
    assert staggered(eng, prompts) == want
    assert eng.pool.num_used == 0


def test_logprobs_are_the_same_bits_alone_and_among_seven_others(tiny_target, tiny_prompts,
                                                                  device):
    """Deterministic mode at the float level: greedy tokens survive a last-bit difference,
    logprobs do not. Alone, each request's forwards have one row; staggered, the batch's
    row count changes every step. Every logprob is the same bits (the matmuls' fixed
    tiles: with M free to vary they differ in the 7th digit)."""
    prompts = [tiny_prompts[i] * (1 + i % 2) for i in range(8)]   # chunks and decode rows
    params = lambda i: SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True,  # noqa: E731
                                      logprobs=2)
    alone = det_engine(tiny_target, device)
    want = [staggered(alone, [p], lambda _, i=i: params(i), "logprobs")[0]
            for i, p in enumerate(prompts)]
    got = staggered(det_engine(tiny_target, device), prompts, params, "logprobs")
    assert got == want


def test_batching_throughput_mode_matches_greedy(tiny_target, tiny_prompts, device):
    """Default (non-deterministic) mode batches decode attention; greedy output on
    the tiny model still equals one-at-a-time."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=512, device=device))
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    together = eng.generate(tiny_prompts[:12], p)
    apart = [eng.generate([x], p)[0] for x in tiny_prompts[:12]]
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in apart]


def test_pool_exhaustion_queues_then_completes(tiny_target, tiny_prompts, device):
    """A pool too small for everyone at once: requests wait (or are preempted and
    recomputed) instead of failing, and all complete with all blocks returned."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=12, block_size=8,
                                 device=device))
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    res = eng.generate(tiny_prompts[:10], p)
    assert all(len(r["token_ids"]) == 20 for r in res)
    assert eng.pool.num_used == 0 and eng.pool.num_free == 12
