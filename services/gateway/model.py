"""What the gateway knows about the model it serves: names, context window, vocabulary and
the tokenizer that renders chat templates. Loaded once from the HF folder."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.engine.archs import context_window
from shared.engine.model_path import resolve

from .config import GatewayConfig
from .defaults import load_generation_defaults


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str                  # the id clients send (served_model_name)
    aliases: frozenset[str]    # other accepted ids (the folder path as given)
    max_model_len: int         # prompt + completion tokens
    vocab_size: int            # ids the model can embed
    tokenizer: Any             # shared.engine.tokenizer.Tokenizer (or a test double)
    created: int               # unix time, for /v1/models
    # generation_config.json sampling defaults for omitted fields (defaults.py), and the cap
    # on generated tokens when a chat-like request sets none (None: the context window)
    sampling_defaults: dict = field(default_factory=dict)
    default_max_tokens: int | None = None
    folder: str = ""                  # where its files are (--model may be a Hub id)
    tool_format: str = "hermes"       # how tool calls are written (shared/toolformats.py)

    def accepts(self, model: str | None) -> bool:
        return model is None or model == self.name or model in self.aliases

    @classmethod
    def load(cls, cfg: GatewayConfig, tokenizer: Any = None) -> "ModelSpec":
        folder = resolve(cfg.model)       # a folder, or a Hub id in the local cache
        if not (folder / "config.json").is_file():
            raise ValueError(f"model folder {folder} has no config.json")
        if tokenizer is None:
            from shared.engine.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(folder, cfg.chat_template or None)
        config = _read_json(folder / "config.json")
        text_config = config.get("text_config") or {}
        window = context_window(config) or getattr(tokenizer, "context_length", None)
        if not window:
            raise ValueError(f"{folder}/config.json has no max_position_embeddings")
        if cfg.max_model_len:        # as the engine: never past the model's own window
            window = min(cfg.max_model_len, int(window))
        vocab = config.get("vocab_size") or text_config.get("vocab_size") or tokenizer.vocab_size
        defaults, cap = load_generation_defaults(folder) if cfg.generation_config else ({}, None)
        return cls(name=cfg.served_model_name, aliases=frozenset({cfg.model, str(folder)}),
                   max_model_len=int(window), vocab_size=int(vocab), tokenizer=tokenizer,
                   created=int(time.time()), sampling_defaults=defaults,
                   default_max_tokens=cap or cfg.default_max_tokens or None,
                   folder=str(folder),
                   tool_format=(cfg.tool_call_parser if cfg.tool_call_parser != "auto"
                                else getattr(tokenizer, "tool_format", "hermes")))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
