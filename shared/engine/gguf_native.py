"""GGUF architectures transformers' GGUF loader does not read (GLM-4), converted here.

The config comes from the file's metadata (`ARCHS` says how, per llama.cpp architecture),
each Hugging Face tensor from the llama.cpp tensor name the `gguf` package maps it to (the
map llama.cpp's own converter writes with), dequantized by the `gguf` package. llama.cpp's
GLM-4 converter (`conversion/glm.py`, `Glm4Model`) stores q and k unpermuted (both sides
rotate interleaved pairs) and the rope dimension as head_dim * partial_rotary_factor, so
nothing is undone but that factor. What the map does not know, a tensor of the file no
Hugging Face parameter takes, or rope scaling, is a CheckpointError naming it.
"""
from __future__ import annotations

from pathlib import Path

from .gguf_header import field_value
from .loader import CheckpointError


def glm4_config(get, tensors: dict) -> tuple[str, dict]:
    """Glm4Config's fields from glm4.* metadata."""
    heads = get("attention.head_count")
    head_dim = get("attention.key_length") or get("embedding_length") // heads
    rope_dim = get("rope.dimension_count") or head_dim // 2
    return "Glm4Config", dict(
        hidden_size=get("embedding_length"), intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"), num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads, head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=get("context_length"),
        rope_parameters={"rope_type": "default", "rope_theta": get("rope.freq_base") or 10000.0,
                         "partial_rotary_factor": rope_dim / head_dim},
        attention_bias="blk.0.attn_q.bias" in tensors)


ARCHS = {"glm4": glm4_config}
# turn-ending tokens a chat model of the family emits besides eos (GLM-4's configs stop on
# <|endoftext|>, <|user|> and <|observation|>; llama.cpp's converter keeps only the first
# two, as eos and eot)
STOP_TOKENS = {"glm4": ("<|user|>", "<|observation|>")}
# llama.cpp's pre-tokenizer names transformers' GGUF reader does not know, with llama.cpp's
# split (LLAMA_VOCAB_PRE_TYPE_CHATGLM4, src/llama-vocab.cpp): digits in groups of up to 3
CHATGLM4_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                  r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"chatglm-bpe": CHATGLM4_SPLIT, "glm4": CHATGLM4_SPLIT, "glm5": CHATGLM4_SPLIT}


def reads(arch: str | None) -> bool:
    return arch in ARCHS


def load_tokenizer(gguf_path: Path, pre: str | None):
    """The tokenizer the metadata describes (transformers' GGUF tokenizer reader, which
    needs no config), split as llama.cpp splits for pre-tokenizers (pre, the file's
    tokenizer.ggml.pre) that reader lacks."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  local_files_only=True)
    split = SPLITS.get(pre)
    if split is not None:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def stop_ids(reader, arch: str) -> list[int]:
    """eos, then eot/eom and the family's turn-ending tokens present in the vocabulary."""
    ids = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is not None:
        want = set(STOP_TOKENS.get(arch, ()))
        ids += [i for i, d in enumerate(f.data) if want and bytes(f.parts[d]).decode() in want]
    return list(dict.fromkeys(i for i in ids if i is not None))


def save_model(gguf_path: Path, out_dir: Path, dtype: str, name: str) -> None:
    """The GGUF's weights and config as a Hugging Face folder (safetensors in dtype)."""
    import gguf
    import numpy as np
    import torch
    import transformers
    from transformers import GenerationConfig

    r = gguf.GGUFReader(str(gguf_path))
    arch = field_value(r, "general.architecture")
    tensors = {t.name: t for t in r.tensors}
    scaling = field_value(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{gguf_path.name}: {arch}.rope.scaling.type {scaling!r} is not "
                              "supported")
    cls, fields = ARCHS[arch](lambda k: field_value(r, f"{arch}.{k}"), tensors)
    ids = {k: field_value(r, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "padding")}
    stops = stop_ids(r, arch)
    eos = stops[0] if len(stops) == 1 else (stops or None)
    fields |= dict(vocab_size=int(tensors["token_embd.weight"].shape[-1]),
                   tie_word_embeddings="output.weight" not in tensors,
                   bos_token_id=ids["bos"], eos_token_id=eos, pad_token_id=ids["padding"])
    config = getattr(transformers, cls)(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    config._name_or_path = name
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    state, used = {}, set()
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        g = names.get_name(base)
        t = tensors.get(f"{g}.{suffix}") if g else None
        if t is None:
            raise CheckpointError(f"{gguf_path.name}: no tensor for {hf_name} "
                                  f"(llama.cpp name {g}.{suffix})")
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        state[hf_name] = torch.from_numpy(w).reshape(p.shape).to(getattr(torch, dtype))
        used.add(t.name)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise CheckpointError(f"{gguf_path.name}: tensors {unknown[:4]} have no place in "
                              f"{config.architectures[0]}")
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if set(missing) - {"lm_head.weight"}:
        raise CheckpointError(f"{gguf_path.name}: {sorted(missing)[:4]} missing")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos,
                                               pad_token_id=ids["padding"])
    model.save_pretrained(out_dir)
