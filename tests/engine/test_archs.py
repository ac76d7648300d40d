"""The architectures a user brings (shared/engine/archs.py), each a tiny random checkpoint
written by transformers' own classes (seeded, saved to a temp dir): greedy tokens equal to
transformers' `generate` and last-position logits within float32 tolerance, on shapes that
differ (head_dim 16/32, GQA ratios 1/2/4, tied and untied heads, a real tokenizer's vocab
size). What the forward does not do is refused by name, never served wrong."""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.loader import CheckpointError, load_config

from .test_parity import LOGIT_ATOL, engine_logits, hf_logits, hf_model

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             max_position_embeddings=256, rms_norm_eps=1e-6)


def checkpoint(path, cls: str, seed: int = 0, **fields):
    import transformers

    cfg = getattr(transformers, cls)(**(SMALL | fields))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():          # biases and norms away from their init, so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    model.save_pretrained(path)
    return path


def engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_blocks=64, block_size=8, dtype="float32"),
                     tokenizer=None)


def greedy(eng: LLMEngine, ids: list[int], n: int) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return eng.generate([ids], sp)[0]["token_ids"]


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


CASES = {
    # q/k RMSNorm per head; head_dim 32 with hidden 64 (not hidden / heads); GQA 4; tied
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                  tie_word_embeddings=True)),
    # the shape a user reported: a real vocabulary (49,152), head_dim 16, GQA 2, defaults
    "qwen2_user": ("Qwen2Config", dict(vocab_size=49152, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=32768)),
    # attention_bias on Llama: q, k, v and o carry biases; MHA (GQA 1), untied
    "llama_bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                       attention_bias=True, tie_word_embeddings=False)),
    # q|k|v and gate|up stored fused; GQA 2
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                pad_token_id=0)),
    # GLM-4: partial (half of each head), interleaved RoPE; post-norms; fused gate|up;
    # q/k/v biases only
    "glm4": ("Glm4Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                attention_bias=True, pad_token_id=0)),
    # every layer slides, over a window the prompts pass
    "mistral_window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8)),
    # local/global layers, soft-capped scores and logits (caps low enough to bite),
    # query_pre_attn_scalar, (1 + w) norms before and after attention and MLP, scaled
    # embeddings, gelu-tanh; head_dim 32, GQA 2, tied
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    sliding_window=6, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                                    pad_token_id=0)),
    # + q/k norms, a RoPE base per layer type; sliding first, then global; head_dim 64, MHA
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, sliding_window=7,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    cls, fields = CASES[request.param]
    return request.param, checkpoint(tmp_path_factory.mktemp(request.param) / "m", cls, **fields)


def test_greedy_tokens_and_logits_equal_transformers(case):
    name, path = case
    ref, eng = hf_model(path, "cpu"), engine(path)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(3, ref.config.vocab_size, (12,), generator=g).tolist()
        assert (engine_logits(eng, ids) - hf_logits(ref, ids)).abs().max() <= LOGIT_ATOL, name
        assert greedy(eng, ids, 32) == hf_greedy(ref, ids, 32), name


def test_a_sliding_window_is_honoured_past_the_window(tmp_path):
    """Past its window a sliding layer sees only the window: a prompt twice the window
    equals transformers, and the same engine with the window off (as the engine was before:
    full attention, or the request refused) does not, so the case tests the window."""
    import dataclasses

    path = checkpoint(tmp_path / "m", "MistralConfig", num_attention_heads=4,
                      num_key_value_heads=2, sliding_window=8)
    ref, eng = hf_model(path, "cpu"), engine(path)
    assert eng.max_model_len == 256 and eng.model_cfg.layer_windows == (8, 8)
    ids = list(range(3, 19))
    assert greedy(eng, ids, 24) == hf_greedy(ref, ids, 24)
    assert (engine_logits(eng, ids) - hf_logits(ref, ids)).abs().max() <= LOGIT_ATOL
    for L in eng.model.layers:
        L.window = 0
    assert (engine_logits(eng, ids) - hf_logits(ref, ids)).abs().max() > 100 * LOGIT_ATOL
    assert dataclasses.replace(eng.model_cfg, layer_windows=()).layer_windows == ()


@pytest.mark.parametrize("cls,fields,named", [
    ("LlamaConfig", dict(mlp_bias=True), "mlp_bias"),
    ("LlamaConfig", dict(hidden_act="relu"), "hidden_act"),
    ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
     "unsupported architecture"),
    ("Gemma3TextConfig", dict(head_dim=16, use_bidirectional_attention=True),
     "use_bidirectional_attention"),
    ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
])
def test_what_the_forward_does_not_do_is_refused_by_name(tmp_path, cls, fields, named):
    path = checkpoint(tmp_path / "m", cls, **fields)
    with pytest.raises(CheckpointError, match=named):
        engine(path)


def test_a_tensor_the_forward_would_not_read_is_refused(tmp_path):
    """Before, a tensor the loader did not expect was dropped and the model answered wrong."""
    from safetensors.torch import load_file, save_file

    path = checkpoint(tmp_path / "m", "LlamaConfig")
    st = path / "model.safetensors"
    tensors = load_file(st) | {"model.layers.0.mlp.up_proj.bias": torch.zeros(128)}
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="up_proj.bias"):
        engine(path)


def test_a_hub_id_in_the_local_cache_is_served_and_one_not_there_is_refused(tmp_path,
                                                                            monkeypatch):
    """`--model org/name` resolves from the local Hugging Face cache (no download, as
    HF_HUB_OFFLINE=1 would have it); an id the cache lacks says where it looked."""
    import shutil

    from huggingface_hub import constants

    from shared.engine.model_path import ModelNotFound, resolve

    src = checkpoint(tmp_path / "m", "Qwen3Config", num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-qwen3" / "snapshots" / ("a" * 40)
    shutil.copytree(src, snap)
    (cache / "models--acme--tiny-qwen3" / "refs").mkdir()
    (cache / "models--acme--tiny-qwen3" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("acme/tiny-qwen3") == snap
    eng = LLMEngine(EngineConfig(model="acme/tiny-qwen3", num_blocks=64, block_size=8,
                                 dtype="float32"), tokenizer=None)
    assert eng.model_cfg.qk_norm
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        resolve("acme/not-here")
    assert resolve(str(src)) == src                       # a folder is used as it is
