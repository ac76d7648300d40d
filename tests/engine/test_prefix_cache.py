"""Prefix cache in the engine: L1 hits and layer-wise loads change no output token.

The load tests play the kvstore's part with a thread that copies a donor engine's KV
into the loading blocks layer by layer, after random delays. With the readiness guard
on, outputs equal the uncached reference; with it off (TEST ONLY switch) compute reads
layers before they land and the same test sees wrong tokens.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.block_pool import BlockPool
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

SHAPES = dict(dtype="float32", deterministic=True, threads=1, block_size=16, chunk_size=32,
              max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(model, device: str, **kw) -> LLMEngine:
    cfg = SHAPES | {"num_blocks": 256, "device": device} | kw
    return LLMEngine(EngineConfig(model=str(model), **cfg), tokenizer=None)


def prompts(n: int, prefix_len: int = 200, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 8000) for _ in range(prefix_len)]
    return [shared + [rng.randrange(10, 8000) for _ in range(rng.randrange(5, 60))]
            for _ in range(n)]


def run_one(eng: LLMEngine, rid: str, p: list[int], **kw) -> list[int]:
    load = eng.add_request(rid, p, GREEDY, **kw)
    toks = []
    while eng.has_unfinished:
        for o in eng.step():
            toks += o.new_token_ids
    return toks, load


@pytest.fixture(scope="module")
def reference(tiny_target, device):
    ref = engine(tiny_target, device, prefix_cache=False)
    ps = prompts(20)
    return ps, [run_one(ref, f"r{i}", p)[0] for i, p in enumerate(ps)]


def test_l1_hits_give_the_same_tokens(tiny_target, reference, device):
    ps, want = reference
    eng = engine(tiny_target, device)
    got = [run_one(eng, f"c{i}", p)[0] for i, p in enumerate(ps)]
    assert got == want
    st = eng.stats()
    # every prompt after the first reuses the shared 192-token (6 whole chunks) prefix
    assert st["prefix_hit_tokens"] == 19 * 192
    assert st["l1_hit_rate"] > 0.8


def test_l1_eviction_under_a_tiny_pool(tiny_target, reference, device):
    ps, want = reference
    eng = engine(tiny_target, device, num_blocks=20)       # one request's worth: cached blocks churn
    got = [run_one(eng, f"e{i}", p)[0] for i, p in enumerate(ps)]
    assert got == want
    assert eng.pool.evictions > 0 and eng.pool.num_free == eng.pool.num_blocks


def _donor_kv(tiny_target, device, p):
    """KV of p's prefix, computed by another engine (what kvstore would hold)."""
    donor = engine(tiny_target, device, prefix_cache=False)
    donor.add_request("d", p, GREEDY, prefill_only=True)
    while donor.has_unfinished:
        donor.step()
    return donor.kv, donor.port.kept_blocks("d")


def _loader(eng, ld, donor_kv, donor_blocks, delay, rng):
    for layer in range(eng.kv.shape[0]):
        time.sleep(rng.uniform(0, delay))
        ids = donor_blocks[ld.first_block:ld.first_block + len(ld.blocks)]
        src = donor_kv[layer, :, torch.tensor(ids, device=donor_kv.device)]
        eng.write_loaded_layer(ld, layer, src)
        ld.layer_done(layer)


def _loaded_run(tiny_target, device, reference, guard: bool) -> int:
    ps, want = reference
    rng = random.Random(1)
    eng = engine(tiny_target, device, prefix_cache=False, load_guard=guard)
    donor_kv, donor_blocks = _donor_kv(tiny_target, device, ps[0])
    wrong = 0
    for i, p in enumerate(ps):
        tier_blocks = 12           # the tier holds the shared prefix: 192 tokens
        load = eng.add_request(f"l{i}", p, GREEDY, tier_blocks=tier_blocks)
        assert load is not None and len(load.blocks) == 12     # 192 tokens from the tier
        t = threading.Thread(target=_loader, args=(eng, load, donor_kv, donor_blocks, 0.02, rng))
        t.start()
        toks = []
        while eng.has_unfinished:
            for o in eng.step():
                toks += o.new_token_ids
        t.join()
        wrong += toks != want[i]
        if guard:
            assert eng.last_load["compute_waits_s"], "compute never waited on a layer"
    return wrong


def test_layer_loads_with_random_delays_give_the_same_tokens(tiny_target, reference, device):
    assert _loaded_run(tiny_target, device, reference, guard=True) == 0


def test_without_the_readiness_guard_outputs_go_wrong(tiny_target, reference, device):
    """The same run with the guard off: compute reads layers that have not landed."""
    wrong = _loaded_run(tiny_target, device, reference, guard=False)
    assert wrong >= 10, f"only {wrong} of 20 outputs wrong without the guard"


def test_a_failed_load_is_recomputed(tiny_target, reference, device):
    ps, want = reference
    eng = engine(tiny_target, device, prefix_cache=False)
    for i, p in enumerate(ps[:3]):
        load = eng.add_request(f"f{i}", p, GREEDY, tier_blocks=12)
        threading.Timer(0.01, load.fail, args=("checksum mismatch",)).start()
        toks = []
        while eng.has_unfinished:
            for o in eng.step():
                toks += o.new_token_ids
        assert toks == want[i]
    assert eng.counters["load_failures"] == 3 and eng.counters["prefix_hit_tokens"] == 0


def test_pool_refcounts_and_lru():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.register(a[0], b"k0")
    pool.register(a[1], b"k1")
    pool.free(a)
    assert pool.num_free == 4 and pool.match([b"k0", b"k1", b"k2"]) == a
    pool.take(pool.match([b"k0"]))
    fresh = pool.allocate(3)            # 2 never-cached, then evicts k1 (k0 is held)
    assert a[0] not in fresh and pool.match([b"k0", b"k1"]) == [a[0]]
    with pytest.raises(ValueError):
        pool.free([a[0], a[0]])
