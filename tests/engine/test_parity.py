"""Our forward and generation equal transformers' on real checkpoints.

Tolerance: logits in float32 agree with transformers' float32 eager forward to
max |diff| <= 2e-4 (relative to logits of magnitude ~10: the two differ only in op
order: fused QKV / gate-up GEMMs, paged gathers, SDPA vs eager attention).
"""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

from .random_models import make_random_model

LOGIT_ATOL = 2e-4


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position, by prefilling the prompt one prefix at a time is slow;
    instead run a prefill and read all rows."""
    from shared.engine.model import BatchMeta, SeqSpan

    n = len(ids)
    blocks = engine.pool.allocate(engine.pool.blocks_for(n))
    try:
        bs = engine.cfg.block_size
        slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)])
        meta = BatchMeta(positions=torch.arange(n), slot_mapping=slots,
                         spans=[SeqSpan(0, n, n, slots)], logits_rows=torch.arange(n))
        return engine.model.forward(torch.tensor(ids), meta, engine.kv)
    finally:
        engine.pool.free(blocks)


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def qwen2_random(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("qwen2") / "m", "qwen2")


@pytest.fixture(scope="module")
def llama_random(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.mark.parametrize("which", ["qwen2_random", "llama_random"])
def test_logits_match_transformers_random_configs(which, request):
    path = request.getfixturevalue(which)
    ref = hf_model(path)
    eng = LLMEngine(EngineConfig(model=str(path), num_blocks=64, block_size=8), tokenizer=None)
    for ids in prompts_for(ref.config.vocab_size, 4):
        want = ref(torch.tensor([ids])).logits[0]
        got = engine_logits(eng, ids)
        assert (got - want).abs().max().item() <= LOGIT_ATOL


def test_logits_match_transformers_tiny_target(tiny_target):
    ref = hf_model(tiny_target)
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=64), tokenizer=None)
    for ids in prompts_for(ref.config.vocab_size, 4, seed=1):
        got = engine_logits(eng, ids)
        assert (got - ref(torch.tensor([ids])).logits[0]).abs().max().item() <= LOGIT_ATOL


def test_logits_match_transformers_smollm2(smollm2):
    ref = hf_model(smollm2)
    eng = LLMEngine(EngineConfig(model=str(smollm2), num_blocks=32), tokenizer=None)
    ids = ref_ids = prompts_for(ref.config.vocab_size, 1, seed=2)[0]
    want = ref(torch.tensor([ref_ids])).logits[0]
    got = engine_logits(eng, ids)
    assert (got - want).abs().max().item() <= 1e-3  # 30 layers: a little more drift


def greedy_hf(ref, ids: list[int], max_new: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_generation_equals_transformers_generate(tiny_target, tiny_prompts):
    ref = hf_model(tiny_target)
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = eng.generate(tiny_prompts, params)
    for ids, g in zip(tiny_prompts, got):
        assert g["token_ids"] == greedy_hf(ref, ids, 24)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_equals_unchunked(tiny_target, tiny_prompts, chunk):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, chunk_size=256))
    chunked = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, chunk_size=chunk))
    a = whole.generate(tiny_prompts[:8], params)
    b = chunked.generate(tiny_prompts[:8], params)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
