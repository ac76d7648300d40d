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
    # the layer's norms by tensor name: before attention, on attention's output (or None),
    # before the MLP, on the MLP's output (or None)
    norms: tuple = ("input_layernorm", None, "post_attention_layernorm", None)
    interleaved_rope: bool = False  # RoPE on pairs (2i, 2i+1) of the rotary part, which may
    #                                 be a fraction of each head (GLM-4)
    gemma: bool = False        # RMSNorm scales by (1 + w) in float32; embeddings scaled by
    #                            sqrt(hidden); the MLP's activation is hidden_activation
    moe: bool = False          # sparse layers: a router picks num_experts_per_tok experts
    #                            per token (Qwen3-MoE: softmax, top-k, norm_topk_prob)
    expert_width: str = "moe_intermediate_size"    # the config field sizing an expert
    renormalise: bool = False  # top-k routing weights always sum to 1 (Mixtral)
    # checkpoint tensor names -> the forward's (substring rewrites, in order)
    names: tuple = ()


MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                 (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))


GLM4_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
              "post_mlp_layernorm")
GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


ARCHS: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(),
    "MistralForCausalLM": Arch(),
    "Qwen2ForCausalLM": Arch(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Arch(qk_norm=True),
    "Phi3ForCausalLM": Arch(fused_qkv=True, fused_gate_up=True),
    "Glm4ForCausalLM": Arch(o_bias=False, fused_gate_up=True, norms=GLM4_NORMS,
                            interleaved_rope=True),
    # soft-capped attention and final logits, local/global layers, query_pre_attn_scalar
    "Gemma2ForCausalLM": Arch(norms=GEMMA_NORMS, gemma=True),
    # + q/k norm, a RoPE base per layer type
    "Gemma3ForCausalLM": Arch(norms=GEMMA_NORMS, gemma=True, qk_norm=True),
    "Qwen3MoeForCausalLM": Arch(qk_norm=True, moe=True),
    # every layer sparse, experts of intermediate_size, top-k renormalised; Mistral's window
    "MixtralForCausalLM": Arch(moe=True, expert_width="intermediate_size", renormalise=True,
                               names=MIXTRAL_NAMES),
}


def canonical_name(name: str, arch: Arch) -> str:
    """A checkpoint's tensor name as the forward reads it (Mixtral's block_sparse_moe and
    w1/w3/w2 are the gate/up/down of mlp.experts)."""
    if ".experts." in name or ".block_sparse_moe." in name:
        for old, new in arch.names:
            name = name.replace(old, new)
    return name
# the activations the MLP computes (transformers' ACT2FN names), as torch's gelu calls them
ACTIVATIONS = {"silu": None, "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def activation(config: Mapping) -> str:
    """The MLP's gate activation: Gemma's hidden_activation, else hidden_act."""
    return config.get("hidden_activation") or config.get("hidden_act") or "silu"


def layer_windows(config: Mapping, num_layers: int) -> tuple[int, ...]:
    """Each layer's attention window (0: the whole context). A key at position k is seen
    from position q when q - window < k <= q (transformers' sliding_window_overlay).
    layer_types names each layer (Gemma 2/3, Qwen2/3 since transformers 5); without it the
    layers from max_window_layers on slide (Qwen2's older configs, as transformers reads
    them), or every layer (Mistral), when sliding_window applies."""
    window = int(config.get("sliding_window") or 0)
    layer_types = config.get("layer_types")
    if not window:
        return (0,) * num_layers
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        return (0,) * num_layers
    if "max_window_layers" in config:     # Qwen2 without layer_types: the layers from it slide
        first = int(config["max_window_layers"] or 0)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers



def rotary_fraction(config: Mapping) -> float:
    """The share of each head's dimensions RoPE turns (partial_rotary_factor)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0)


def moe_layers(config: Mapping, num_layers: int) -> tuple[bool, ...]:
    """Which layers route to experts (Qwen3-MoE): every decoder_sparse_step-th one not in
    mlp_only_layers, when the config has experts."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(bool(experts) and i not in dense and (i + 1) % step == 0
                 for i in range(num_layers))


def context_window(config: Mapping) -> int | None:
    """How many tokens a request may hold: max_position_embeddings (a multimodal config's
    text_config's). A sliding-window layer attends its own window (layer_windows), so the
    window bounds no request."""
    text = config.get("text_config") or {}
    window = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return int(window) if window else None


def refusals(config: Mapping, arch: str) -> list[str]:
    """The fields of config this engine cannot honour, each with why."""
    out = []
    act = activation(config)
    if act not in ACTIVATIONS:
        out.append(f"hidden_act={act!r} (the MLP's gate is one of {sorted(ACTIVATIONS)})")
    if arch.endswith("MoeForCausalLM") and (config.get("shared_expert_intermediate_size")
                                            or config.get("n_shared_experts")):
        out.append("shared experts (a dense expert beside the routed ones)")
    if config.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention=true (an encoder's mask; this engine is causal)")
    if config.get("mlp_bias"):
        out.append("mlp_bias=true (the MLP projections carry no bias here)")
    partial = rotary_fraction(config)
    if partial != 1.0 and not ARCHS[arch].interleaved_rope:
        out.append(f"partial_rotary_factor={partial} (RoPE turns every dimension of a head)")
    return out
