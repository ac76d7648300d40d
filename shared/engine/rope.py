"""Rotary position embedding tables, computed the way transformers does for the config
(default, linear, dynamic, yarn, llama3, ... via transformers' own init functions)."""
from __future__ import annotations

import torch

from .loader import CheckpointError, ModelConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


def inv_freq_and_scaling(cfg: ModelConfig, layer_type: str = "full_attention"
                         ) -> tuple[torch.Tensor, float]:
    """layer_type: which layers' RoPE, where the config gives one per layer type (Gemma 3:
    a local base for sliding layers)."""
    hf = cfg.hf_config
    params = getattr(hf, "rope_parameters", None) or {}
    per_type = any(t in params for t in LAYER_TYPES)
    if per_type:
        params = params.get(layer_type) or params.get("full_attention") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        D = cfg.rotary_dim or cfg.head_dim      # a partial rotary turns the first D only
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"unsupported rope_type {rope_type!r}")
    if rope_type == "dynamic":
        raise CheckpointError("dynamic NTK RoPE changes with sequence length; not supported")
    kw = {"layer_type": layer_type} if per_type else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kw)
    return inv.float(), float(scaling)


def rope_cos_sin(cfg: ModelConfig, dtype: torch.dtype, layer_type: str = "full_attention"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position, rotary dims], in the model dtype (as transformers casts
    them)."""
    inv, scaling = inv_freq_and_scaling(cfg, layer_type)
    t = torch.arange(cfg.max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv)                      # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)          # [P, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
