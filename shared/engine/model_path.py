"""What `--model` names: a local folder, a GGUF file (converted once into pdmesh's cache,
gguf_convert.py), or a Hugging Face id (`org/name`, optionally `org/name@revision`)
already in the local Hugging Face cache. Nothing is downloaded at run
time: an id the cache does not hold is refused with where it looked and how to fetch it."""
from __future__ import annotations

import re
from pathlib import Path


class ModelNotFound(ValueError):
    """--model names neither a folder nor a model in the local Hugging Face cache."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")


def resolve(model: str) -> Path:
    """The folder `model` names; ModelNotFound when there is none."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from .gguf_convert import cached_folder
        return cached_folder(path)
    if path.exists() or not HUB_ID.match(model):
        return path        # a folder (or a path the loader explains): used as it is
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id, _, revision = model.partition("@")
    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision or None,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError) as e:
        raise ModelNotFound(
            f"{model}: not a local folder, and not in the Hugging Face cache ({HF_HUB_CACHE}): "
            f"nothing is downloaded at run time; fetch it where the Hub is reachable "
            f"(`hf download {repo_id}`) and copy the cache, or pass a folder "
            f"({type(e).__name__})") from None


AUTO_QUANTIZE = "int4"   # quantize "auto" for a folder that is no GGUF conversion


def auto_quantize(folder: Path) -> str:
    """quantize "auto": the precision of the GGUF the folder was converted from
    (gguf_header.engine_quantization), else AUTO_QUANTIZE."""
    import logging

    from .gguf_convert import file_quantization
    q = file_quantization(folder)
    logging.getLogger("pdmesh.engine").info(
        "quantize auto: %s (%s)", (AUTO_QUANTIZE if q is None else q) or "none",
        "not a GGUF conversion" if q is None else "the GGUF's own precision"
        + ("; act_int8, smoothquant and head_split need a quantized model" if not q else ""))
    return AUTO_QUANTIZE if q is None else q
