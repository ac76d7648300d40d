"""Sampling: seeded streams independent of batch and process, processors do what
their names say, stop strings cut at the right character."""
from __future__ import annotations

import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling import SampleInput, sample

from .test_batching import det_engine


def si(params, seed=7, position=10, out=()):
    return SampleInput(params, seed, position, [1, 2, 3], list(out))


def test_seeded_draw_depends_only_on_seed_and_position():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, [si(p), si(p, position=11), si(p, seed=8)])
    # same row alone, in a different batch position, in a fresh call
    b = sample(logits[[2, 0]], [si(p, seed=8), si(p)])
    assert a[0].token == b[1].token and a[2].token == b[0].token
    draws = {sample(logits[:1], [si(p, position=k)])[0].token for k in range(50)}
    assert len(draws) > 5  # positions give different streams


def test_a_batch_samples_each_row_as_it_would_alone():
    """The plain greedy rows take one argmax over the batch; rows with something to apply
    (penalties, a bias, a ban, logprobs, a seed) are processed row by row. Every row's
    token is the one it gets sampled alone, ties included (the first index)."""
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    logits[1, [17, 400]] = 50.0                            # a tie: 17 both ways
    logits[2, 2], logits[2, 500] = 10.0, 9.0               # the penalty on prompt token 2 flips it
    g = SamplingParams(temperature=0.0)
    rows = [si(g), si(g), si(SamplingParams(temperature=0.0, repetition_penalty=1.3)),
            si(SamplingParams(temperature=0.0, logit_bias={5: 100.0})),
            SampleInput(g, 7, 10, [1], [], banned=frozenset({int(logits[4].argmax())})),
            si(SamplingParams(temperature=0.0, logprobs=2)),
            si(SamplingParams(temperature=1.0, seed=3)), si(g)]
    batch = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [r])[0] for i, r in enumerate(rows)]
    assert [o.token for o in batch] == [o.token for o in alone]
    assert batch[1].token == 17 and batch[2].token == 500 and batch[3].token == 5
    assert batch[4].token != int(logits[4].argmax())
    assert batch[5].top_logprobs == alone[5].top_logprobs and batch[0].logprob is None


def test_seeded_sampling_reproducible_across_batch_compositions(tiny_target, tiny_prompts,
                                                                 device):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    alone = det_engine(tiny_target, device).generate([tiny_prompts[0]], p)[0]["token_ids"]
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=5 + i, ignore_eos=True)
              for i in range(7)]
    eng = det_engine(tiny_target, device)
    mixed = eng.generate(tiny_prompts[1:8] + [tiny_prompts[0]], others + [p])
    assert mixed[-1]["token_ids"] == alone


def test_sampled_tokens_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    for k in range(3000):
        counts[sample(logits, [si(SamplingParams(seed=1), position=k)])[0].token] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_processors():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 500, generator=g)
    top = int(logits.argmax())
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [si(greedy)])[0].token == top
    assert sample(logits, [si(SamplingParams(top_k=1, seed=1))])[0].token == top
    assert sample(logits, [si(SamplingParams(min_p=1.0, seed=1))])[0].token == top
    assert sample(logits, [si(SamplingParams(top_p=1e-6, seed=1))])[0].token == top
    biased = SamplingParams(temperature=0.0, logit_bias={17: 100.0})
    assert sample(logits, [si(biased)])[0].token == 17
    pen = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample(logits, [si(pen, out=[top] * 3)])[0].token != top
    rep = SamplingParams(temperature=0.0, repetition_penalty=100.0)
    assert sample(logits, [SampleInput(rep, 0, 4, [top], [])])[0].token != top
    banned = SampleInput(greedy, 0, 4, [], [], banned=frozenset({top}))
    assert sample(logits, [banned])[0].token != top
    lp = sample(logits, [si(SamplingParams(temperature=0.0, logprobs=3))])[0]
    assert lp.top_logprobs[0][0] == top and abs(lp.logprob - lp.top_logprobs[0][1]) < 1e-6
    assert abs(lp.logprob - float(torch.log_softmax(logits[0], -1)[top])) < 1e-6


def test_stop_string_split_across_tokens(tiny_target, tiny_tokenizer, tiny_prompts, device):
    """The stop string straddles a token boundary (2 chars of token k, 2 of token k+1):
    the text is cut exactly where it starts, although token k+1 was generated whole."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, device=device))
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in tiny_prompts:
        full = eng.generate([prompt], base)[0]
        text, ids = full["text"], full["token_ids"]
        ends = [len(tiny_tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
        for k in range(1, len(ids) - 1):
            b = ends[k]
            if b < 2 or ends[k + 1] < b + 2 or not text.startswith(tiny_tokenizer.decode(ids[:k + 1])):
                continue
            stop = text[b - 2:b + 2]
            if text.find(stop) != b - 2:
                continue
            cut = eng.generate([prompt], SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
            assert cut["finish_reason"] == "stop"
            assert cut["text"] == text[:b - 2]
            assert cut["token_ids"] == ids[:k + 1]
            kept = eng.generate([prompt], SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,),
                include_stop_str_in_output=True))[0]
            assert kept["text"] == text[:b + 2]
            return
    raise AssertionError("no generation had a token boundary to test")


def test_max_tokens_and_min_tokens(tiny_target, tiny_prompts, tiny_tokenizer, device):
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, device=device))
    r = eng.generate([tiny_prompts[0]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(r["token_ids"]) <= 5
    eos = next(iter(tiny_tokenizer.eos_token_ids))
    forced = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, logit_bias={eos: 100.0})
    r = eng.generate([tiny_prompts[0]], forced)[0]
    assert len(r["token_ids"]) == 5 and r["token_ids"][-1] == eos and r["finish_reason"] == "stop"
