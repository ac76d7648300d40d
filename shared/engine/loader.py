"""Checkpoint loading: a local HF folder of an architecture archs.py describes ->
ModelConfig + weights.

Config comes through transformers' AutoConfig; weights straight from safetensors (one
file or a sharded index). Everything is validated up front, so a bad checkpoint fails
with a message that names what is wrong instead of a shape error mid-forward; a field
the forward does not honour (archs.refusals) or a tensor it would not read is refused by
name, never dropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .archs import (
    ARCHS,
    activation,
    canonical_name,
    context_window,
    layer_windows,
    moe_layers,
    refusals,
    rotary_fraction,
)


class CheckpointError(ValueError):
    """The folder is not a checkpoint this engine can serve."""


def check_stop_ids(folder, tokenizer, vocab_size: int) -> None:
    """Every id that ends a generation (tokenizer, generation_config.json, config.json)
    is a row of the model's logits: an id past them could never be sampled and breaks
    every grammar's stop mask, so the checkpoint is refused by name at load."""
    if tokenizer is None:
        return
    bad = sorted(i for i in tokenizer.eos_token_ids if not 0 <= i < vocab_size)
    if bad:
        raise CheckpointError(f"{folder}: eos_token_id {bad} outside the model's vocabulary "
                              f"({vocab_size} rows; generation_config.json / config.json)")


SUPPORTED_ARCHITECTURES = sorted(ARCHS)
# tensors a checkpoint may carry that the forward recomputes (older Llama exports)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int          # RoPE's table (max_position_embeddings)
    tie_word_embeddings: bool
    attention_bias: bool       # q/k/v biases
    hf_config: object  # the transformers config, for RoPE parameters
    o_bias: bool = False       # an o_proj bias (attention_bias on Llama, Mistral, Qwen3)
    qk_norm: bool = False      # Qwen3: RMSNorm over each q and k head before RoPE
    arch: object = None        # archs.Arch: what differs from Llama
    rotary_dim: int = 0        # dimensions of a head RoPE turns (0: all)
    max_context: int = 0       # what a request may hold (max_position_embeddings)
    layer_windows: tuple = ()  # each layer's sliding window, 0 for the whole context
    act: str = "silu"          # the MLP's gate activation (archs.ACTIVATIONS)
    attn_scale: float = 0.0    # q.k scale (Gemma: query_pre_attn_scalar ** -0.5); 0: D ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before softmax (Gemma 2)
    final_softcap: float = 0.0  # the same on the final logits (Gemma 2)
    moe_layers: tuple = ()     # which layers route to experts (archs.moe_layers)
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False   # the top-k routing weights renormalised to sum to 1

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_config(path: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        hf = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - surface transformers' reason
        raise CheckpointError(f"{path}: config.json cannot be read: {e}") from e
    archs = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in archs if a in ARCHS), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: unsupported architecture {archs or hf.model_type!r}; "
            f"supported: {SUPPORTED_ARCHITECTURES}")
    d = hf.to_dict()
    if why := refusals(d, arch):
        raise CheckpointError(f"{path}: not supported: {'; '.join(why)}")
    spec = ARCHS[arch]
    biased = bool(getattr(hf, "attention_bias", False))
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=spec.qkv_bias or biased,
        hf_config=hf,
        o_bias=biased and spec.o_bias,
        qk_norm=spec.qk_norm,
        arch=spec,
        rotary_dim=int(head_dim * rotary_fraction(d)),
        max_context=context_window(d) or hf.max_position_embeddings,
        layer_windows=layer_windows(d, hf.num_hidden_layers),
        act=activation(d),
        attn_scale=(d["query_pre_attn_scalar"] ** -0.5 if d.get("query_pre_attn_scalar")
                    else 0.0),
        attn_softcap=float(d.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(d.get("final_logit_softcapping") or 0.0),
        moe_layers=moe_layers(d, hf.num_hidden_layers) if spec.moe else (),
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0)
        if spec.moe else 0,
        experts_per_tok=int(d.get("num_experts_per_tok") or 0) if spec.moe else 0,
        moe_intermediate_size=int(d.get(spec.expert_width) or 0) if spec.moe else 0,
        norm_topk_prob=spec.renormalise or bool(d.get("norm_topk_prob")),
    )


def expected_shapes(cfg: ModelConfig, fused_experts: bool = False
                    ) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, with its shape. fused_experts: a MoE layer's experts
    as two [E, ...] tensors (how transformers 5 saves them) rather than one set per
    expert (the Hub's Qwen3-MoE checkpoints)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, H),
        "model.norm.weight": (H,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = cfg.arch or ARCHS["LlamaForCausalLM"]
        shapes |= {p + f"{n}.weight": (H,) for n in a.norms if n}
        shapes[p + "self_attn.o_proj.weight"] = (H, cfg.num_heads * D)
        if cfg.moe_layers and cfg.moe_layers[i]:
            shapes |= _expert_shapes(cfg, p, fused_experts)
        elif a.fused_gate_up:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * I, H)
        else:
            shapes |= {p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H)}
        if not (cfg.moe_layers and cfg.moe_layers[i]):
            shapes[p + "mlp.down_proj.weight"] = (H, I)
        if a.fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (cfg.q_size + 2 * cfg.kv_size, H)
        else:
            shapes |= {p + "self_attn.q_proj.weight": (cfg.q_size, H),
                       p + "self_attn.k_proj.weight": (cfg.kv_size, H),
                       p + "self_attn.v_proj.weight": (cfg.kv_size, H)}
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (cfg.q_size,),
                p + "self_attn.k_proj.bias": (cfg.kv_size,),
                p + "self_attn.v_proj.bias": (cfg.kv_size,),
            }
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
    return shapes


def _expert_shapes(cfg: ModelConfig, p: str, fused: bool) -> dict[str, tuple[int, ...]]:
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {p + "mlp.gate.weight": (E, H)}
    if fused:
        return shapes | {p + "mlp.experts.gate_up_proj": (E, 2 * I, H),
                         p + "mlp.experts.down_proj": (E, H, I)}
    for e in range(E):
        x = f"{p}mlp.experts.{e}."
        shapes |= {x + "gate_proj.weight": (I, H), x + "up_proj.weight": (I, H),
                   x + "down_proj.weight": (H, I)}
    return shapes


def _names(f: Path) -> list[str]:
    with safe_open(str(f), framework="pt") as st:
        return list(st.keys())


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    path = Path(path)
    files = _weight_files(path)
    spec = cfg.arch or ARCHS[cfg.architecture]
    want = expected_shapes(cfg, fused_experts=bool(cfg.moe_layers) and any(
        canonical_name(n, spec).endswith("mlp.experts.gate_up_proj")
        for f in files for n in _names(f)))
    got: dict[str, torch.Tensor] = {}
    unread: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                key = canonical_name(name, spec)
                if key in want:
                    got[key] = st.get_tensor(name).to(device=device, dtype=dtype)
                elif not name.endswith(IGNORED_SUFFIXES) and not (
                        cfg.tie_word_embeddings and name == "lm_head.weight"):
                    unread.append(name)
    if unread:      # a tensor the forward would not use changes the model: never dropped
        more = f" (+{len(unread) - 5} more)" if len(unread) > 5 else ""
        raise CheckpointError(f"{path}: tensors this engine does not use ({cfg.architecture} "
                              f"as config.json describes it): {sorted(unread)[:5]}{more}")
    missing = sorted(set(want) - set(got))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensors: {missing[:5]}{more}")
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(got[name].shape)}, "
                f"config implies {shape}")
    return got


def draft_config(cfg, target):
    """The draft model's config when cfg speculates (None otherwise); it must share the
    target's vocabulary."""
    if not cfg.speculative or not cfg.draft_model:
        return None
    from .model_path import resolve

    dc = load_config(resolve(cfg.draft_model))
    if dc.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {cfg.draft_model} has vocab_size {dc.vocab_size}; "
                         f"the target's is {target.vocab_size}: they must share a "
                         "tokenizer")
    return dc
