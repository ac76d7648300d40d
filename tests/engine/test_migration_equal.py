"""Invariant 7 at its root: a migrated request continues as `prompt + tokens so far`, which the
new instance computes as a prefill, while the uninterrupted one computed those tokens' KV as
decode steps. In deterministic mode both must give bit-equal KV, or a long greedy output
diverges mid-stream (issue 30: 1-2 of 16 streams of 200 tokens, after a 5 s partition).
Every row is attended as its own decode step computes it (batch.py), so a position's KV
depends on the tokens only, never on how they were computed."""
from __future__ import annotations

import pytest

from shared.contracts.sampling import SamplingParams
from tests.conftest import CODE_PROMPTS, TINY_TARGET
from tests.engine.test_batching import det_engine

N = 200


def product_engine(device: str, **kw):
    """The engine as `pdmesh up --deterministic` builds decode's (bfloat16, its batch)."""
    return det_engine(TINY_TARGET, device, **({"dtype": "bfloat16", "chunk_size": 256,
                                               "max_num_batched_tokens": 256} | kw))


@pytest.fixture(scope="module")
def engine(device):
    return product_engine(device)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer.encode(p) for p in CODE_PROMPTS[:10]]


@pytest.fixture(scope="module")
def refs(engine, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    return [o["token_ids"] for o in engine.generate(prompts, sp)]


@pytest.mark.parametrize("k", [1, 4, 37])
def test_a_continuation_from_k_tokens_equals_the_uninterrupted_output(engine, prompts, refs, k):
    """Before the fix (a chunk attended as one causal block), 4-5 of these 10 prompts
    diverged at each k, 26-142 tokens after the resume."""
    sp = SamplingParams(temperature=0.0, max_tokens=N - k, ignore_eos=True)
    outs = engine.generate([p + r[:k] for p, r in zip(prompts, refs)], sp)
    diverged = {i: next(j for j, (a, b) in enumerate(zip(o["token_ids"], r[k:])) if a != b)
                for i, (o, r) in enumerate(zip(outs, refs)) if o["token_ids"] != r[k:]}
    assert diverged == {}, f"prompt -> first differing token after the resume: {diverged}"


def test_a_prompt_split_into_chunks_anywhere_gives_the_same_output(engine, prompts, refs,
                                                                  device):
    """The same, for a prefill split at other chunk boundaries (chunk_size 256 vs 7)."""
    other = product_engine(device, chunk_size=7)
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    long = [p + r[:60] for p, r in zip(prompts[:4], refs)]
    a = [o["token_ids"] for o in engine.generate(long, sp)]
    b = [o["token_ids"] for o in other.generate(long, sp)]
    assert a == b
