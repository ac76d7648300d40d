"""Speculative verification: greedy equals the argmax chain, rejection sampling emits
exactly the target distribution (and a broken rule does not), draws depend only on
(seed, position)."""
from __future__ import annotations

import importlib

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.sampling import SampleInput, sample
from shared.engine.spec import VerifyInput, processed_probs, verify

# the package's `verify` is the function; the module itself, for monkeypatching
verify_mod = importlib.import_module("shared.engine.spec.verify")

GREEDY = SamplingParams(temperature=0.0)
# chi-square critical values at p = 0.001, by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_CRIT_001 = {5: 20.515, 7: 24.322}


def vin(params, out=(), seed=7, position=20, **kw):
    return VerifyInput(params, seed, position, [1, 2, 3], list(out), **kw)


def reference_chain(logits, params, out, n):
    """Non-speculative greedy: one sample() per row, output_ids growing."""
    chain = []
    for i in range(n):
        si = SampleInput(params, 7, 20 + i, [1, 2, 3], list(out) + chain)
        chain.append(sample(logits[i:i + 1], [si])[0].token)
    return chain


# greedy

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mismatch", [0, 1, 3, None])
def test_greedy_equals_the_argmax_chain(seed, mismatch):
    k, V = 4, 50
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                            logit_bias={5: 1.0})
    out = [5, 9]
    chain = reference_chain(logits, params, out, k + 1)
    drafts = chain[:k]
    if mismatch is not None:
        drafts[mismatch] = (drafts[mismatch] + 1) % V
    res = verify(drafts, None, logits, vin(params, out))
    n = k if mismatch is None else mismatch
    assert res.tokens == chain[:n + 1]
    assert res.num_accepted == n


def test_greedy_all_accepted_gives_the_bonus_token():
    logits = torch.full((3, 10), -1.0)
    logits[0, 4] = logits[1, 6] = logits[2, 2] = 5.0
    res = verify([4, 6], None, logits, vin(GREEDY))
    assert res.tokens == [4, 6, 2] and res.num_accepted == 2


def test_greedy_first_token_mismatch_gives_the_target_argmax():
    logits = torch.full((3, 10), -1.0)
    logits[0, 4] = logits[1, 6] = logits[2, 2] = 5.0
    res = verify([5, 6], None, logits, vin(GREEDY))
    assert res.tokens == [4] and res.num_accepted == 0


def test_no_drafts_is_a_plain_step():
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(1))
    assert verify([], None, logits, vin(GREEDY)).tokens == [int(logits[0].argmax())]


def test_penalties_see_the_accepted_drafts():
    # row 1 prefers token 3 by a hair; once the draft 3 is in the output, the penalty flips it
    logits = torch.zeros(3, 8)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 4] = 5.0, 4.9
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    res = verify([3, 3], None, logits, vin(params))
    assert res.tokens == [3, 4] and res.num_accepted == 1


def test_grammar_mask_and_banned_ids_reject_drafts():
    logits = torch.zeros(3, 8)
    logits[:, 3] = 5.0
    logits[:, 2] = 4.0
    masks = torch.ones(3, 8, dtype=torch.bool)
    masks[1, 3] = False
    res = verify([3, 3], None, logits, vin(GREEDY, allowed_masks=masks))
    assert res.tokens == [3, 2]
    banned = [frozenset({3}), frozenset(), frozenset()]
    assert verify([3, 3], None, logits, vin(GREEDY, banned=banned)).tokens == [2]


# sampled

def draw(q: torch.Tensor, g: torch.Generator) -> int:
    return int(torch.multinomial(q, 1, generator=g))


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over p's support; asserts nothing lands outside it."""
    support = p > 0
    assert int(counts[~support].sum()) == 0, "tokens outside the target's support"
    n = counts.sum()
    exp = n * p[support]
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# temperature + top-k on both sides; the draft's top 6 differs from the target's
SAMPLED = SamplingParams(temperature=0.8, top_k=6, seed=1)
TARGET = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.2, 1.0, 2.0, -0.3, 1.2, 0.0, -1.0, 0.5]])
DRAFT = torch.tensor([[-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, -2.0]])
TRIALS = 20_000


def first_token_counts(rule) -> torch.Tensor:
    q = processed_probs(DRAFT[0], SAMPLED, [1, 2, 3])
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(8)
    for t in range(TRIALS):
        x = draw(q, g)
        counts[rule(x, q, t)] += 1
    return counts


def spec_rule(x, q, t):
    return verify([x], q.view(1, -1), TARGET, vin(SAMPLED, seed=t)).tokens[0]


def test_first_emitted_token_follows_the_target_distribution():
    p = processed_probs(TARGET[0], SAMPLED, [1, 2, 3])
    stat, df = chi_square(first_token_counts(spec_rule), p)
    assert df == 5
    assert stat < CHI2_CRIT_001[df], stat


def test_broken_rules_fail_the_same_test(monkeypatch):
    p = processed_probs(TARGET[0], SAMPLED, [1, 2, 3])
    # always accept the draft: emits q, which even puts mass outside p's support
    with pytest.raises(AssertionError, match="outside the target's support"):
        chi_square(first_token_counts(lambda x, q, t: x), p)
    # resample from p instead of the residual after a rejection
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    stat, df = chi_square(first_token_counts(spec_rule), p)
    assert stat > 10 * CHI2_CRIT_001[df], stat


def test_bonus_token_follows_the_target_distribution():
    # draft == target at row 0: always accepted, so the bonus row is sampled every time
    # (no penalties in SAMPLED, so p1 does not depend on the accepted draft)
    p0 = processed_probs(TARGET[0], SAMPLED, [1, 2, 3])
    p1 = processed_probs(TARGET[1], SAMPLED, [1, 2, 3])
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(8)
    for t in range(TRIALS // 2):
        res = verify([draw(p0, g)], p0.view(1, -1), TARGET, vin(SAMPLED, seed=t))
        assert res.num_accepted == 1
        counts[res.tokens[1]] += 1
    stat, df = chi_square(counts, p1)
    assert stat < CHI2_CRIT_001[df], stat


def test_disallowed_draft_is_never_accepted():
    masks = torch.ones(2, 8, dtype=torch.bool)
    masks[0, 0] = False
    q = torch.zeros(1, 8)
    q[0, 0] = 1.0          # a draft that knows nothing of the grammar
    for t in range(200):
        res = verify([0], q, TARGET, vin(SAMPLED, seed=t, allowed_masks=masks))
        assert res.num_accepted == 0 and res.tokens[0] != 0


def test_draws_depend_only_on_seed_and_position():
    q = processed_probs(DRAFT[0], SAMPLED).view(1, -1)
    a = [verify([d], q, TARGET, vin(SAMPLED, seed=s, position=30)).tokens
         for s in range(40) for d in (0, 5)]
    b = [verify([d], q.clone(), TARGET.clone(), vin(SAMPLED, seed=s, position=30)).tokens
         for s in range(40) for d in (0, 5)]
    assert a == b
    by_pos = {tuple(verify([5], q, TARGET, vin(SAMPLED, seed=3, position=p)).tokens)
              for p in range(40)}
    assert len(by_pos) > 3   # positions give different streams


# shared pieces

def test_processed_probs():
    row = torch.randn(8, generator=torch.Generator().manual_seed(0))
    g = processed_probs(row, GREEDY)
    assert g.sum() == 1.0 and g[row.argmax()] == 1.0
    p = processed_probs(row, SAMPLED)
    assert abs(float(p.sum()) - 1.0) < 1e-6 and int((p > 0).sum()) == 6


def test_logprobs_are_the_raw_target_rows():
    params = SamplingParams(temperature=0.0, logprobs=2)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))
    res = verify([int(logits[0].argmax()), 0], None, logits, vin(params))
    for i, o in enumerate(res.outputs):
        lp = torch.log_softmax(logits[i], -1)
        assert o.logprob == pytest.approx(float(lp[o.token]))
        assert len(o.top_logprobs) == 2


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_logits"):
        verify([1, 2], None, torch.zeros(2, 8), vin(GREEDY))
    with pytest.raises(ValueError, match="draft_probs"):
        verify([1], None, torch.zeros(2, 8), vin(SAMPLED))
