"""Randomly initialised checkpoints written with transformers' own save_pretrained, for
parity tests on configurations the bundled models do not cover."""
from __future__ import annotations

from pathlib import Path

import torch


def make_random_model(path: Path, arch: str = "qwen2", **overrides) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6)
    if arch == "qwen2":  # attention bias on q/k/v, untied head
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
    else:
        cfg = LlamaConfig(**common, tie_word_embeddings=True)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make biases non-zero so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path
