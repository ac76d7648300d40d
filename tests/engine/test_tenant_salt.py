"""Tenant isolation of the prefix cache in the engine (issue 12): a request's cache_salt
starts the chain of its prefix keys, so the same prompt under two salts shares no block
in L1 (add_request and hold alike), and the keys a lower tier (kvstore) would be asked
for differ in every block."""
from __future__ import annotations

import random

from services.decode.jobs import make_prefill_job
from shared.contracts.common import Codec, encode
from shared.contracts.messages import DecodeSubmit, KvDestination, PrefillJob
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine(model, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", threads=1, block_size=16,
                                  num_blocks=256, device=device), tokenizer=None)


def prompt(n: int = 130, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def run(eng: LLMEngine, rid: str, p: list[int], salt: str) -> int:
    """The request's cached prompt tokens (after it ran to the end)."""
    eng.add_request(rid, p, GREEDY, cache_salt=salt)
    seq = eng.requests[rid].seq
    eng.step()                # admitted (a partial block's copy is taken then)
    cached = seq.num_cached
    while eng.has_unfinished:
        eng.step()
    return cached


def test_prefix_keys_differ_per_salt_in_every_block(tiny_target, device):
    eng = engine(tiny_target, device)
    p = prompt()
    plain, a, a2, b = (eng.prefix_keys(p), eng.prefix_keys(p, "tenant-a"),
                       eng.prefix_keys(p, "tenant-a"), eng.prefix_keys(p, "tenant-b"))
    assert a == a2 and len(a) == len(b) == len(plain) == 8
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)


def test_the_same_prompt_never_hits_across_salts(tiny_target, device):
    eng = engine(tiny_target, device)
    p = prompt()
    assert run(eng, "a1", p, "A") == 0
    assert run(eng, "a2", p, "A") == 129           # 8 whole blocks from L1, and the tail's
    #                                                 first token (the second is computed)
    assert eng.cached_prefix_tokens(p, "B") == 0
    assert run(eng, "b1", p, "B") == 0             # tenant B: nothing of A's
    assert run(eng, "b2", p, "B") == 129
    assert run(eng, "n1", p, "") == 0              # unsalted: a tenant of its own
    assert eng.cached_prefix_tokens(p, "A") == eng.cached_prefix_tokens(p, "B") == 128


def test_held_sequences_are_salted_too(tiny_target, device):
    """Decode's PD slots (hold) and its fallback (requeue) use the request's salt."""
    eng = engine(tiny_target, device)
    p = prompt(seed=1)
    run(eng, "a1", p, "A")
    seq, _ = eng.port.hold("h-b", p, GREEDY, cache_salt="B")
    assert seq.num_cached == 0
    blocks = eng.port.detach_blocks("h-b")
    eng.port.free_blocks(blocks)
    eng.port.requeue("h-b")                              # prefill locally: still tenant B
    assert eng.requests["h-b"].seq.num_cached == 0
    eng.abort("h-b")
    seq, _ = eng.port.hold("h-a", p, GREEDY, cache_salt="A")
    assert seq.num_cached == 128


def test_the_salt_crosses_decode_to_prefill():
    sub = DecodeSubmit(request_id="r", prompt_ids=[1, 2, 3], params=GREEDY,
                       tokenizer_fingerprint="fp", reply_subject="x", cache_salt="s" * 32)
    dest = KvDestination(instance_id="d", block_ids=[1], epochs=[1])
    job = Codec(PrefillJob).decode(encode(make_prefill_job(sub, dest, "m", 16)))
    assert job.cache_salt == sub.cache_salt
