"""Token-level prefix reuse: a prompt's last, partial block is indexed too, so a repeated
or continued prompt computes one token where whole blocks alone left up to 16, and what
it serves is what computing would give: the KV copied is the KV a cold prefill writes,
bit for bit; the one token computed alone may differ in its last bits (a one-row forward
takes other kernels than a 37-row one, as after any prefix hit outside deterministic mode).

The engine as `pdmesh up` runs it (not deterministic: there whole chunks alone are
shared, and this reuse is off)."""
from __future__ import annotations

import random

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BS = 16


def engine(model, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", threads=1, block_size=BS, num_blocks=64) | kw
    return LLMEngine(EngineConfig(model=str(model), **cfg), tokenizer=None)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def same_kv(got: torch.Tensor, want: torch.Tensor, served: int) -> bool:
    """Positions served from the cache bit for bit, the rest to float32 rounding."""
    return (torch.equal(got[:, :, :served], want[:, :, :served])
            and torch.allclose(got, want, rtol=0, atol=1e-4))


def run(eng: LLMEngine, rid: str, prompt: list[int], **kw) -> tuple[list[int], int, torch.Tensor]:
    """(greedy tokens, prompt tokens served from the cache, the prompt's KV: every layer's
    K and V of each prompt position, read before the request finishes)."""
    eng.add_request(rid, prompt, GREEDY, **kw)
    seq = eng.requests[rid].seq
    toks, cached, kv = [], None, None
    while eng.has_unfinished:
        for o in eng.step():
            toks += o.new_token_ids
            cached = o.num_cached_tokens
        if kv is None and seq.num_computed >= len(prompt):
            pos = torch.arange(len(prompt))
            blocks = torch.tensor(seq.block_table)[pos // BS]
            kv = eng.kv[:, :, blocks, pos % BS].clone()
    return toks, cached, kv


@pytest.fixture(scope="module")
def cold(tiny_target):
    """Each prompt computed whole, by an engine with no prefix cache."""
    ref = engine(tiny_target, prefix_cache=False)
    return lambda rid, p: run(ref, rid, p)


@pytest.mark.parametrize("n,served", [(37, 36), (32, 31), (20, 19)])
def test_a_repeated_prompt_computes_its_last_token_alone(tiny_target, cold, n, served):
    """37 tokens: 2 whole blocks + 4 of the tail's 5 (one left to compute); 32: the
    second whole block is cached but taking it whole would leave nothing, so 15 of it."""
    p = ids(n, seed=n)
    want, _, want_kv = cold(f"ref{n}", p)
    eng = engine(tiny_target)
    first, cached1, kv1 = run(eng, "a", p)
    again, cached2, kv2 = run(eng, "b", p)
    assert cached1 == 0 and cached2 == served
    assert first == again == want
    assert torch.equal(kv1, want_kv) and same_kv(kv2, want_kv, served)
    assert eng.stats()["tail_hit_tokens"] == served - (n - 1) // BS * BS


def test_a_continued_prompt_reuses_the_previous_tail(tiny_target, cold):
    """A chat's next turn: the previous prompt (2 blocks + 5 tokens) then more tokens. The
    continuation takes the 2 blocks and the 5 tail tokens, and computes the rest."""
    a = ids(37, seed=1)
    b = a + ids(30, seed=2)
    want, _, want_kv = cold("refb", b)
    eng = engine(tiny_target)
    _, _, kv_a = run(eng, "a", a)
    got, cached, kv = run(eng, "b", b)
    assert cached == 37 and got == want
    # the 37 served positions are a's KV bit for bit; against b computed whole (a 67-row
    # forward, not 37 then 30) all of it to float32 rounding
    assert torch.equal(kv[:, :, :37], kv_a) and same_kv(kv, want_kv, 0)


@pytest.mark.parametrize("n", [37, 12])
def test_tails_never_cross_tenants(tiny_target, n):
    """12 tokens: the tail is the first block, keyed from the tenant's salt itself."""
    p = ids(n, seed=3)
    eng = engine(tiny_target)
    run(eng, "a", p, cache_salt="tenant-a")
    _, cached, _ = run(eng, "b", p, cache_salt="tenant-b")
    assert cached == 0 and eng.stats()["tail_hit_tokens"] == 0
    _, cached, _ = run(eng, "c", p, cache_salt="tenant-a")
    assert cached == n - 1


def test_off_in_deterministic_mode_and_without_the_prefix_cache(tiny_target):
    p = ids(37, seed=4)
    for kw in ({"deterministic": True, "chunk_size": 32, "max_num_batched_tokens": 128},
               {"prefix_cache": False}):
        eng = engine(tiny_target, **kw)
        run(eng, "a", p)
        run(eng, "b", p)
        assert eng.stats()["tail_hit_tokens"] == 0, kw


def test_a_tiny_pool_evicting_the_source_still_serves_it(tiny_target, cold):
    """Three blocks, all cached after the first run: the repeat takes the two whole ones,
    and its fresh block can only be the tail's source itself, evicted; outputs stay the
    cold ones."""
    p = ids(37, seed=5)
    want, _, want_kv = cold("ref5", p)
    eng = engine(tiny_target, num_blocks=3)
    run(eng, "a", p)
    got, cached, kv = run(eng, "b", p)
    assert cached == 36 and got == want and same_kv(kv, want_kv, 36)


def test_a_waiting_request_holds_no_block_of_its_own(tiny_target, cold):
    """The copy goes into a block of the request's own: taken as the scheduler admits it,
    so queued repeats hold only the shared whole blocks (a queue of requests each holding
    a private block could leave too few for the running ones, which never preempt it)."""
    p = ids(37, seed=6)
    want, _, _ = cold("ref6", p)
    eng = engine(tiny_target, max_num_seqs=1)
    run(eng, "a", p)
    eng.add_request("long", ids(40, seed=7), GREEDY)      # holds the one running place
    eng.step()
    free = eng.pool.num_free
    for i in range(5):
        eng.add_request(f"r{i}", p, GREEDY)
    assert [len(eng.requests[f"r{i}"].seq.block_table) for i in range(5)] == [2] * 5
    assert eng.pool.num_free == free - 2       # the two whole blocks, shared, and no more
    got = {}
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_id.startswith("r") and o.finished:
                assert o.num_cached_tokens == 36
    assert all(got[f"r{i}"] == want for i in range(5))
