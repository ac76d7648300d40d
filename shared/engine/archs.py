"""The architectures the engine serves, each a short description over the one forward in
model.py, and what a checkpoint may ask that the forward does not do (refused by name).

Pure: reads a config as a dict (config.json, or a transformers config's to_dict()), so the
gateway can ask the same questions without loading the model."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arch:
    qkv_bias: bool = False     # q/k/v carry a bias whatever attention_bias says (Qwen2)
    qk_norm: bool = False      # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    fused: bool = False        # q|k|v and gate|up stored as one tensor each (Phi-3)


ARCHS: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(),
    "MistralForCausalLM": Arch(),
    "Qwen2ForCausalLM": Arch(qkv_bias=True),
    "Qwen3ForCausalLM": Arch(qk_norm=True),
    "Phi3ForCausalLM": Arch(fused=True),
}


def sliding_window(config: Mapping) -> int | None:
    """The attention window some layer keeps, or None when every layer attends to the whole
    context: Mistral's sliding_window; for Qwen2/Qwen3, sliding_window where layer_types
    (or use_sliding_window) turns it on."""
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if "use_sliding_window" in config:
        return int(window) if config["use_sliding_window"] else None
    return int(window)


def context_window(config: Mapping) -> int | None:
    """How many tokens a request may hold: max_position_embeddings, or the sliding window
    when one applies and is shorter. Inside the window, sliding and full attention are the
    same computation; the engine serves no request that could pass it (as vLLM does for a
    model whose sliding window it does not implement)."""
    text = config.get("text_config") or {}
    window = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    slide = sliding_window(config) or sliding_window(text)
    if window and slide:
        return min(int(window), slide)
    return int(window) if window else slide


def refusals(config: Mapping, arch: str) -> list[str]:
    """The fields of config this engine cannot honour, each with why."""
    out = []
    act = config.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act!r} (the MLP is SiLU-gated)")
    if config.get("mlp_bias"):
        out.append("mlp_bias=true (the MLP projections carry no bias here)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        out.append(f"partial_rotary_factor={partial} (RoPE turns every dimension of a head)")
    if config.get("attention_bias") and arch == "Qwen2ForCausalLM":
        out.append("attention_bias=true on Qwen2 (an o_proj bias Qwen2 does not have)")
    return out
