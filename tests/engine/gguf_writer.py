"""A Hugging Face folder written as a GGUF file with the `gguf` package's writer (what
llama.cpp's convert_hf_to_gguf.py does for these architectures, in the few lines a test
needs): llama.cpp's tensor names and metadata keys, Llama's q/k rows permuted as llama.cpp
stores them, F32 tensors, and the byte-level BPE tokenizer (tokens, merges, token types,
special ids, chat template)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCHS = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
         "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Glm4ForCausalLM": gguf.MODEL_ARCH.GLM4}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a Llama q/k projection's rows (transformers undoes it)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(folder: Path, out: Path, name: str = "tiny", sampling: dict | None = None,
               quant: gguf.GGMLQuantizationType | None = None, extra=None,
               pre: str = "default") -> Path:
    """quant: the matrices (not norms) stored in this llama.cpp block type (Q8_0, Q4_0);
    extra(writer): adds what a test needs besides (a key, a tensor); pre: llama.cpp's
    pre-tokenizer name."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    key = gguf.MODEL_ARCH_NAMES[arch]
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), key)
    w.add_name(name)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    # GLM-4 rotates part of each head (llama.cpp's Glm4Model: head_dim * the factor)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(head_dim * partial))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for k, v in (sampling or {}).items():
        getattr(w, f"add_sampling_{k}")(v)
    _tokenizer(w, folder, cfg, pre)
    names = gguf.get_tensor_name_map(arch, n)
    for hf_name, t in load_file(folder / "model.safetensors").items():
        t = t.float()
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
            t = _permute(t, cfg["num_attention_heads"])
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
            t = _permute(t, cfg["num_key_value_heads"])
        data = t.numpy().astype(np.float32)
        if quant is not None and data.ndim == 2:
            w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")),
                         gguf.quants.quantize(data, quant), raw_dtype=quant)
            continue
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w: gguf.GGUFWriter, folder: Path, cfg: dict, pre: str = "default") -> None:
    tj = json.loads((folder / "tokenizer.json").read_text())
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"] | {a["content"]: a["id"] for a in tj["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tj["model"]["merges"]])
    for attr, tok in (("bos", tc.get("bos_token")), ("eos", tc.get("eos_token"))):
        if tok:
            getattr(w, f"add_{attr}_token_id")(vocab[tok])
    template = tc.get("chat_template") or (
        (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.jinja").is_file() else None)
    if template:
        w.add_chat_template(template)
