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
    o_bias: bool = True        # attention_bias biases o_proj too (not Qwen2's, not GLM-4's)
    qk_norm: bool = False      # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    fused_qkv: bool = False    # q|k|v stored as one qkv_proj tensor (Phi-3)
    fused_gate_up: bool = False    # gate|up stored as one gate_up_proj tensor (Phi-3, GLM-4)
    post_norms: bool = False   # an RMSNorm on the attention's and the MLP's outputs (GLM-4)
    interleaved_rope: bool = False  # RoPE on pairs (2i, 2i+1) of the rotary part, which may
    #                                 be a fraction of each head (GLM-4)


ARCHS: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(),
    "MistralForCausalLM": Arch(),
    "Qwen2ForCausalLM": Arch(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Arch(qk_norm=True),
    "Phi3ForCausalLM": Arch(fused_qkv=True, fused_gate_up=True),
    "Glm4ForCausalLM": Arch(o_bias=False, fused_gate_up=True, post_norms=True,
                            interleaved_rope=True),
}


def rotary_fraction(config: Mapping) -> float:
    """The share of each head's dimensions RoPE turns (partial_rotary_factor)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0)


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
    partial = rotary_fraction(config)
    if partial != 1.0 and not ARCHS[arch].interleaved_rope:
        out.append(f"partial_rotary_factor={partial} (RoPE turns every dimension of a head)")
    return out
