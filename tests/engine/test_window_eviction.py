"""A model whose every layer slides (Mistral with `sliding_window`) keeps about a window of
KV per sequence: blocks no future token can see go back to the pool as the sequence
grows (scheduler.evict), and nothing it answers changes, also when those blocks are
handed to other sequences at once and when the prefix cache shares its prompt.

The reference is transformers' forward over the whole sequence, greedy a token at a time:
its `generate` (sliding-window cache) parts from that forward on some of these prompts
past the window (by 0.03 in a logit, e.g. token 13 of a 24-token prompt, window 16),
while the engine's decode steps equal the whole-sequence forward bit for bit."""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

from .test_archs import checkpoint
from .test_parity import hf_model


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' whole-sequence forward, greedy, one token at a time (no cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]

WINDOW, BS = 16, 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = checkpoint(tmp_path_factory.mktemp("w") / "m", "MistralConfig",
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    return path, hf_model(path, "cpu")


def make(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), num_blocks=256, block_size=BS, dtype="float32",
               chunk_size=8, max_num_batched_tokens=64) | kw
    return LLMEngine(EngineConfig(**cfg), tokenizer=None)


def run(eng: LLMEngine, prompts: list[list[int]], n: int, after: int = 0
        ) -> tuple[list[list[int]], int]:
    """Greedy outputs and the most blocks in use after any step once every request has
    `after` tokens out."""
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for rid, p in zip(out, prompts):
        eng.add_request(rid, p, sp)
    peak = 0
    while eng.has_unfinished:
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        if min(map(len, out.values())) >= after:
            peak = max(peak, eng.pool.num_used)
    return list(out.values()), peak


def test_a_long_generation_holds_a_window_of_blocks_and_equals_transformers(mistral):
    """40 prompt tokens and 120 generated with a 16-token window: transformers' tokens,
    while past its first tokens the sequence never holds more than the window's blocks and
    two (160 tokens would take 40 blocks). The prompt's 10 blocks stay until its first
    token (the kvstore write-back copies the whole prompt then)."""
    path, ref = mistral
    eng = make(path, prefix_cache=False)
    ids = [(7 * i) % 500 + 3 for i in range(40)]
    (got,), peak = run(eng, [ids], 120, after=2 * WINDOW)
    assert got == hf_greedy(ref, ids, 120)
    assert peak <= WINDOW // BS + 3, peak
    assert eng.stats()["blocks_evicted"] >= 30
    assert eng.pool.num_used == 0          # every block back, none freed twice


def test_blocks_given_back_serve_others_at_once_and_change_nothing(mistral):
    """A pool too small for three whole contexts (24 blocks, 3 x 30 needed): the three
    run together on blocks the others gave back, no one preempted, each answer
    transformers' for its prompt alone."""
    path, ref = mistral
    eng = make(path, num_blocks=24, prefix_cache=False)
    prompts = [[(k * 13 + 5 * i) % 500 + 3 for i in range(24)] for k in range(3)]
    got, peak = run(eng, prompts, 96)
    assert got == [hf_greedy(ref, p, 96) for p in prompts]
    assert eng.stats()["blocks_evicted"] > 3 * 20


def test_a_shared_prompt_served_from_the_prefix_cache_after_eviction(mistral):
    """The first request's prompt blocks are indexed before they are given back (an
    evicted entry is never registered), so a second request with the same prompt,
    served from the prefix cache, answers as computed alone."""
    path, ref = mistral
    eng = make(path)
    ids = [(11 * i) % 500 + 3 for i in range(48)]
    (first,), _ = run(eng, [ids], 64)
    (second,), _ = run(eng, [ids + [9, 10]], 32)
    assert eng.stats()["l1_hit_blocks"] >= 8
    assert first == hf_greedy(ref, ids, 64)
    assert second == hf_greedy(ref, ids + [9, 10], 32)


def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path):
    """Gemma 2 alternates local and global layers: the global ones see the whole context,
    so nothing is evicted."""
    path = checkpoint(tmp_path / "g", "Gemma2Config", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, sliding_window=8)
    eng = make(path, prefix_cache=False)
    assert eng.scheduler.window == 0
    (got,), peak = run(eng, [list(range(3, 43))], 40)
    assert peak >= 80 // BS and eng.stats()["blocks_evicted"] == 0


def test_the_whole_prompt_is_there_for_the_kvstore_write_back(mistral):
    """A prompt past window + chunk: at its first token (when decode copies a prompt it
    computed to kvstore) every prompt block and key is still the sequence's; a write-back
    of only the tail could never be hit (lookups match from the first block)."""
    path, _ = mistral
    eng = make(path)
    ids = [(3 * i) % 500 + 3 for i in range(48)]
    eng.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not any(o.new_token_ids for o in eng.step()):
        pass
    blocks, keys = eng.port.computed_prompt_blocks("r")
    assert len(keys) == len(blocks) == 48 // BS
    assert blocks == eng.requests["r"].seq.block_table[:48 // BS]
    eng.step()
    eng.step()
    assert eng.requests["r"].seq.num_evicted > 0         # and given back once past it
