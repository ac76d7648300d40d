"""The architectures a user brings (shared/engine/archs.py), each a tiny random checkpoint
written by transformers' own classes (seeded, saved to a temp dir): greedy tokens equal to
transformers' `generate` and last-position logits within float32 tolerance, on shapes that
differ (head_dim 16/32, GQA ratios 1/2/4, tied and untied heads, a real tokenizer's vocab
size). What the forward does not do is refused by name, never served wrong."""
from __future__ import annotations

import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.batch import DET_TILE
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.loader import CheckpointError

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


MOE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[1])

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
    # 8 experts, top 2 renormalised, layer 1 dense (mlp_only_layers); q/k norm; GQA 2
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    # every layer sparse, saved as block_sparse_moe.experts.N.w1/w3/w2, experts of
    # intermediate_size, top 2 always renormalised, a sliding window the prompts pass
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=32, sliding_window=8)),
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
    ("OlmoConfig", dict(num_attention_heads=4, num_key_value_heads=2),
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


def test_moe_experts_stored_per_expert_load_the_same(tmp_path):
    """The Hub's Qwen3-MoE checkpoints hold one gate/up/down per expert; transformers 5
    saves [E, ...] tensors. Both load into the same model."""
    from safetensors.torch import load_file, save_file

    path = checkpoint(tmp_path / "m", "Qwen3MoeConfig", **MOE)
    ids = list(range(3, 15))
    want = engine_logits(engine(path), ids)
    st = path / "model.safetensors"
    split = {}
    for name, t in load_file(st).items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                split[f"{p}{e}.gate_proj.weight"] = gate.contiguous()
                split[f"{p}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                split[f"{p}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            split[name] = t
    save_file(split, st, metadata={"format": "pt"})
    assert torch.equal(engine_logits(engine(path), ids), want)


def test_a_moe_decode_step_reads_only_the_routed_experts(tmp_path, monkeypatch):
    """One decode row reads experts_per_tok experts per sparse layer, never the others:
    the weight bytes it touches are the active parameters', and weight_bytes says so."""
    import shared.engine.model as model_mod

    path = checkpoint(tmp_path / "m", "Qwen3MoeConfig", **MOE)
    eng = engine(path)
    m = eng.model
    experts = {id(w): (li, e) for li, L in enumerate(m.layers) for e, pair in
               enumerate(L.experts or ()) for w in pair}
    read = []
    real = model_mod.linear
    monkeypatch.setattr(model_mod, "linear", lambda x, w, b=None, tile=0: (
        read.append(id(w)), real(x, w, b, tile))[1])
    meta, kv = model_mod.one_prompt(m.cfg, 1, torch.float32)
    m.forward(torch.tensor([7]), meta, kv)
    touched = {experts[w] for w in read if w in experts}
    assert len(touched) == MOE["num_experts_per_tok"]              # of 8, each read once
    assert sum(w in experts for w in read) == 2 * len(touched)     # its gate|up and down
    assert {li for li, _ in touched} == {0}                        # layer 1 is dense
    E, k = MOE["num_experts"], MOE["num_experts_per_tok"]
    per_expert = sum(w.numel() * 4 for w in m.layers[0].experts[0])
    dense_all = m.weight_bytes - k * per_expert + E * per_expert
    assert m.weight_bytes < dense_all and dense_all - m.weight_bytes == (E - k) * per_expert


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_staggered_requests_equal_alone_in_deterministic_mode(tmp_path, name):
    """Continuous batching changes no token on the paths these add: windowed and
    soft-capped attention (a decode row and a deterministic prompt's row compute alike)
    and expert GEMMs (each padded to the batch's fixed M)."""
    from .test_batching import params_for, staggered

    cls, fields = CASES[name]
    path = checkpoint(tmp_path / "m", cls, **fields)
    det = lambda: LLMEngine(EngineConfig(  # noqa: E731
        model=str(path), num_blocks=256, block_size=8, deterministic=True, max_num_seqs=8,
        max_num_batched_tokens=64, chunk_size=16, dtype="float32"), tokenizer=None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (5 + 4 * i,), generator=g).tolist() for i in range(8)]
    alone = det()
    want = [alone.generate([p], params_for(i))[0]["token_ids"] for i, p in enumerate(prompts)]
    assert staggered(det(), prompts) == want


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_weights_serve_these_architectures(tmp_path, name, quantize):
    """int8/int4 reach every linear weight, experts included, and stay close to float
    (random weights: a loose bound; int4's accuracy budget is measured on the bundled
    model, tests/engine/test_quant.py)."""
    cls, fields = CASES[name]
    path = checkpoint(tmp_path / "m", cls, **fields)
    full = engine(path)
    q = LLMEngine(EngineConfig(model=str(path), num_blocks=64, block_size=8, dtype="float32",
                               quantize=quantize), tokenizer=None)
    ids = list(range(3, 20))
    a, b = engine_logits(full, ids), engine_logits(q, ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > (
        0.99 if quantize == "int8" else 0.9)
    assert q.model.weight_bytes < full.model.weight_bytes * 0.6


def test_a_rows_expert_output_is_the_same_bits_whatever_shares_its_batch(tmp_path):
    """Deterministic mode's premise for a sparse layer: each expert's GEMMs run in tiles of
    a fixed M, so a row's output does not depend on how many others chose the same expert
    (without tiles, the rows differ by ~6e-8 at SmolLM2's hidden size)."""
    path = checkpoint(tmp_path / "m", "Qwen3MoeConfig", **(MOE | dict(
        hidden_size=576, moe_intermediate_size=256, head_dim=64, num_attention_heads=9,
        num_key_value_heads=3)))
    m = engine(path).model
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(0))
    full = m.moe(x, m.layers[0], DET_TILE)
    for i in range(16):
        assert torch.equal(m.moe(x[i:i + 1], m.layers[0], DET_TILE)[0], full[i])


def test_speculative_greedy_output_equals_plain_on_every_architecture(case):
    """Model-free speculation (ngram, what `pdmesh up` runs) verifies k drafts in one
    multi-row step through each architecture's own attention (windows, soft caps, q/k
    norms, experts): greedy output is plain decoding's, token for token (deterministic)."""
    name, path = case
    det = dict(model=str(path), num_blocks=128, block_size=8, dtype="float32",
               deterministic=True, max_num_seqs=3, max_num_batched_tokens=32, chunk_size=16)
    plain = LLMEngine(EngineConfig(**det), tokenizer=None)
    spec = LLMEngine(EngineConfig(**det, spec_method="ngram", num_speculative_tokens=4,
                                  spec_adaptive=False), tokenizer=None)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (6,), generator=g).tolist() * 3 for _ in range(3)]
    # 64 tokens: past every window, and long enough for each random model to repeat itself
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = [o["token_ids"] for o in plain.generate(prompts, sp)]
    assert [o["token_ids"] for o in spec.generate(prompts, sp)] == want, name
    assert spec.counters["spec_proposed"] > 0, name


def test_stop_ids_past_the_vocabulary_are_refused_at_load(tmp_path, tiny_target):
    """GLM-4's config says eos_token_id [151329, ...]; with a smaller vocabulary (here the
    tiny tokenizer's 8192) no such token exists: refused by name at load, not an
    IndexError in the grammar's stop mask at the first tool_choice request."""
    import shutil

    path = checkpoint(tmp_path / "m", "Glm4Config", vocab_size=8192, head_dim=16,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / f, path / f)
    with pytest.raises(CheckpointError, match=r"eos_token_id \[151329, 151336, 151338\] "
                                              r"outside the model's vocabulary \(8192"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=16, block_size=8))


def test_layer_windows_read_as_transformers_reads_them():
    """A Qwen2 config without layer_types slides only from max_window_layers on (so KV is
    never given back for its full-attention layers); Mistral's slides everywhere; a saved
    layer_types wins."""
    import transformers

    from shared.engine.archs import layer_windows

    q = dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    want = transformers.Qwen2Config(**q, num_hidden_layers=3).layer_types
    assert layer_windows(q, 3) == tuple(8 if t == "sliding_attention" else 0 for t in want)
    assert layer_windows(q, 3) == (0, 8, 8)
    assert layer_windows({"sliding_window": 8}, 2) == (8, 8)
    assert layer_windows(q | {"layer_types": ["sliding_attention", "full_attention"]}, 2) == (8, 0)
