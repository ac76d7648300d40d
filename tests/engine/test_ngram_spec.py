"""Model-free speculation (spec_method ngram): drafts are the tokens that followed the
latest earlier occurrence of the sequence's last n tokens; verified by the target, so
greedy output is token for token plain decoding's, sampled output keeps the target's
distribution, and a constrained request stays inside its grammar."""
from __future__ import annotations

import json

import pytest

from shared.contracts.constraint import Constraint, ConstraintKind
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.spec.ngram import propose


def test_proposals_continue_the_latest_earlier_occurrence():
    assert propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose([5, 1, 2, 7, 7, 1, 2, 8, 1, 2], 2) == [8, 1]    # the latest, longest n
    assert propose([1, 2, 3, 4], 4) == []                           # nothing repeats
    assert propose([4, 4, 4, 4, 4], 3) == [4]                       # what exists after it
    assert propose([1, 2], 0) == []


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=512, block_size=16, **kw))


@pytest.fixture(scope="module")
def pair(tiny_target):
    return engine(tiny_target), engine(tiny_target, spec_method="ngram", spec_adaptive=False)


def test_greedy_output_equals_plain_decoding(pair, tiny_prompts):
    plain, spec = pair
    prompts = [p * 3 for p in tiny_prompts[:6]]          # text that repeats itself drafts
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o["token_ids"] for o in plain.generate(prompts, sp)]
    before = dict(spec.counters)
    assert [o["token_ids"] for o in spec.generate(prompts, sp)] == want
    proposed = spec.counters["spec_proposed"] - before["spec_proposed"]
    accepted = spec.counters["spec_accepted"] - before["spec_accepted"]
    assert proposed > 0 and accepted > 0, (proposed, accepted)


def test_sampled_requests_are_seeded_and_finish(pair, tiny_prompts):
    _, spec = pair
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)
    a = spec.generate([tiny_prompts[0] * 3], sp)[0]["token_ids"]
    b = spec.generate([tiny_prompts[0] * 3], sp)[0]["token_ids"]
    assert len(a) == 32 and a == b


def test_a_constrained_request_stays_in_its_grammar(pair):
    _, spec = pair
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    c = Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema=json.dumps(schema))
    ids = spec.tokenizer.encode('{"a": "x", "b": 1} {"a": "x", "b": 1} {"a": "x", "b":')
    spec.add_request("c1", ids, SamplingParams(temperature=0.0, max_tokens=40), constraint=c)
    text = ""
    while spec.has_unfinished:
        for o in spec.step():
            text += o.text
    obj = json.loads(text)
    assert set(obj) == {"a", "b"} and isinstance(obj["b"], int)


def test_deterministic_mode_with_ngram_drafts_equals_plain_deterministic(tiny_target,
                                                                       tiny_prompts):
    """pdmesh up --deterministic speculates too (n-gram drafts, k fixed): each
    verification row is the row a plain deterministic step computes."""
    det = dict(deterministic=True, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32)
    plain, spec = engine(tiny_target, **det), engine(tiny_target, spec_method="ngram", **det)
    prompts = [p * 2 for p in tiny_prompts[:4]]
    for sp in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),):
        assert [o["token_ids"] for o in spec.generate(prompts, sp)] == \
            [o["token_ids"] for o in plain.generate(prompts, sp)]
    assert spec.counters["spec_accepted"] > 0
