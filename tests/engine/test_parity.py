"""Our forward and generation equal transformers' on real checkpoints.

Tolerance: logits in float32 agree with transformers' float32 eager forward to
max |diff| <= 2e-4 (relative to logits of magnitude ~10: the two differ only in op
order: fused QKV / gate-up GEMMs, paged gathers, SDPA vs eager attention). transformers
runs on the engine's device, so each device is compared with itself.
"""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

from .random_models import make_random_model

LOGIT_ATOL = 2e-4


def hf_model(path, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval().to(device)


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position, on the host (as the engine returns them)."""
    with torch.no_grad():
        return ref(torch.tensor([ids], device=ref.device)).logits[0].cpu()


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position, by prefilling the prompt one prefix at a time is slow;
    instead run a prefill and read all rows."""
    from shared.engine.batch import BatchMeta, SeqSpan

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
def test_logits_match_transformers_random_configs(which, request, device):
    path = request.getfixturevalue(which)
    ref = hf_model(path, device)
    eng = LLMEngine(EngineConfig(model=str(path), num_blocks=64, block_size=8, device=device),
                    tokenizer=None)
    for ids in prompts_for(ref.config.vocab_size, 4):
        want = hf_logits(ref, ids)
        got = engine_logits(eng, ids)
        assert (got - want).abs().max().item() <= LOGIT_ATOL


def test_logits_match_transformers_tiny_target(tiny_target, device):
    ref = hf_model(tiny_target, device)
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=64, device=device),
                    tokenizer=None)
    for ids in prompts_for(ref.config.vocab_size, 4, seed=1):
        got = engine_logits(eng, ids)
        assert (got - hf_logits(ref, ids)).abs().max().item() <= LOGIT_ATOL


def test_logits_match_transformers_smollm2(smollm2, device):
    ref = hf_model(smollm2, device)
    eng = LLMEngine(EngineConfig(model=str(smollm2), num_blocks=32, device=device),
                    tokenizer=None)
    ids = prompts_for(ref.config.vocab_size, 1, seed=2)[0]
    want = hf_logits(ref, ids)
    got = engine_logits(eng, ids)
    assert (got - want).abs().max().item() <= 1e-3  # 30 layers: a little more drift


def greedy_hf(ref, ids: list[int], max_new: int) -> list[int]:
    out = ref.generate(torch.tensor([ids], device=ref.device), max_new_tokens=max_new,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_generation_equals_transformers_generate(tiny_target, tiny_prompts, device):
    ref = hf_model(tiny_target, device)
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, device=device))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = eng.generate(tiny_prompts, params)
    for ids, g in zip(tiny_prompts, got):
        assert g["token_ids"] == greedy_hf(ref, ids, 24)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_equals_unchunked(tiny_target, tiny_prompts, chunk, device):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cfg = dict(model=str(tiny_target), num_blocks=256, device=device)
    whole = LLMEngine(EngineConfig(**cfg, chunk_size=256))
    chunked = LLMEngine(EngineConfig(**cfg, chunk_size=chunk))
    a = whole.generate(tiny_prompts[:8], params)
    b = chunked.generate(tiny_prompts[:8], params)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
