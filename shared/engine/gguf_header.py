"""What a GGUF's header says, read once: the metadata the converter needs (name,
architecture, tensor types, sampling defaults, pre-tokenizer), the engine quantization
that keeps the file's precision, and one_parse(), under which every reader of a file
(transformers' config, tokenizer and weights loaders among them) shares one parse."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def one_parse():
    """Each GGUF parsed once, and each tensor-name map built once, while this holds.
    transformers parses the file anew for the config, the tokenizer and the weights
    (read_metadata once more): each parse walks every metadata field through numpy memmaps,
    ~4.5 s for SmolLM2's 49k-token vocabulary and merges. Its weights map builds gguf's
    TensorNameMap for every module it visits (397 times for SmolLM2, ~5 s). Both are
    read-only once made (a reader is memmapped), so one serves every caller: SmolLM2's
    conversion 26.3 -> ~13 s, the same bytes."""
    import gguf

    reader_of, map_of = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_of(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = map_of(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_of, map_of


# general.sampling.* (llama.cpp's GGUF keys) -> generation_config.json fields
SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def field_value(reader, key: str):
    """One scalar or string metadata value of a gguf.GGUFReader (None when absent)."""
    import gguf

    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types and f.types[0] == gguf.GGUFValueType.STRING \
        else v.tolist()[0]


def read_metadata(gguf_path: Path) -> dict:
    """What the converter needs from a GGUF's header: name, tensor types, sampling
    defaults (general.sampling.*; do_sample when a temperature is set)."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))

    def value(key):
        return field_value(r, key)

    sampling = {hf: value(f"general.sampling.{k}") for k, hf in SAMPLING_KEYS.items()}
    sampling = {k: (round(v, 6) if isinstance(v, float) else v)      # float32 in the file
                for k, v in sampling.items() if v is not None}
    if sampling.get("temperature"):
        sampling["do_sample"] = True
    arch = value("general.architecture")
    layer_elements: dict[str, int] = {}
    for t in r.tensors:        # the layers' matrices (not norms, embeddings or the head)
        if t.name.startswith("blk.") and len(t.shape) >= 2:
            name = t.tensor_type.name
            layer_elements[name] = layer_elements.get(name, 0) + int(t.n_elements)
    return {"name": value("general.name"), "architecture": arch,
            "head_dim": value(f"{arch}.attention.key_length"),
            "tensor_types": {t.tensor_type.name for t in r.tensors}, "sampling": sampling,
            "pre_tokenizer": value("tokenizer.ggml.pre"),
            "quantization": engine_quantization(layer_elements)}


# llama.cpp's block types by bits per weight -> the engine mode that keeps that precision
# (int4: groups of 32, the Q4 grids; int8: per channel); anything else stays unquantized
INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
              "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}
INT8_TYPES = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


def engine_quantization(layer_elements: dict[str, int]) -> str:
    """The engine's quantize mode for a GGUF whose layer matrices hold layer_elements
    weights of each llama.cpp type: the type of most of them decides (a Q4_K_M file is
    mostly Q4_K with some Q6_K: int4). F32/F16/BF16 files are served unquantized."""
    if not layer_elements:
        return ""
    main = max(layer_elements, key=layer_elements.get)
    return "int4" if main in INT4_TYPES else "int8" if main in INT8_TYPES else ""
