"""Sampling defaults a model's authors recommend, read from its `generation_config.json`.

vLLM does the same (`--generation-config auto`, its default): the fields a request omits
take the model folder's values instead of OpenAI's (temperature 1.0, top_p 1.0, ...). A
small instruct model sampled at temperature 1.0 answers in noise; its card says 0.2.

    temperature, top_p, top_k, min_p, repetition_penalty   -> SamplingParams defaults
    max_new_tokens                                         -> the default cap on generated
                                                              tokens (chat-like endpoints)

Values of the wrong type or out of range are dropped with a warning (a bad file must not
turn every request into a 400). `--no-generation-config` turns all of it off.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from shared.contracts.sampling import SamplingParams

log = logging.getLogger("pdmesh.gateway")

# generation_config.json key -> (SamplingParams field, type)
FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
          "repetition_penalty": float}


def load_generation_defaults(folder: str | Path) -> tuple[dict, int | None]:
    """(sampling defaults, max_new_tokens or None) from folder/generation_config.json."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, None
    if not isinstance(config, dict):
        return {}, None
    out: dict = {}
    for key, typ in FIELDS.items():
        value = config.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if typ is int and value != int(value):
            continue
        value = typ(value)
        if key == "top_k" and value == -1:      # transformers / vLLM spell "off" as -1
            value = 0
        try:
            SamplingParams(**{key: value}).check()
        except ValueError as e:
            log.warning("%s: ignoring %s=%r (%s)", path, key, value, e)
            continue
        out[key] = value
    cap = config.get("max_new_tokens")
    cap = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None
    if out or cap:
        log.info("sampling defaults from %s: %s%s", path, out,
                 f", max_new_tokens={cap}" if cap else "")
    return out, cap
