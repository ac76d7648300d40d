"""Tokenizer wrapper: chat template (+ tool template fallback), fingerprint, incremental
detokenizer.

`Tokenizer` wraps `transformers.AutoTokenizer` with what the serving path needs:

    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode_chat(messages, tools=tools)   # template rendered, then encoded, no extra BOS
    tok.eos_token_ids                              # every id that ends a generation
    tok.fingerprint                                # sha256 of what maps text <-> ids

The fingerprint travels in every prefill job; decode refuses a job whose fingerprint is not
its own (design invariant 2), so it must change whenever any token's meaning could change
and never between processes that load the same files.

`IncrementalDetokenizer` turns generated ids into text one token at a time, emitting a
character only once all of its bytes have arrived.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

TEMPLATES_DIR = Path(__file__).parent / "templates"
TOOL_TEMPLATE = TEMPLATES_DIR / "hermes_tools.jinja"
EXTRA_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, hf: Any, path: str | os.PathLike | None = None):
        self.hf = hf
        self.path = Path(path) if path is not None else None
        self._model_config = _read_json(self.path / "config.json") if self.path else {}
        self._generation_config = (_read_json(self.path / "generation_config.json")
                                   if self.path else {})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike,
                        chat_template: str | os.PathLike | None = None) -> "Tokenizer":
        """chat_template: a Jinja file that replaces the model's template."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            hf.chat_template = Path(chat_template).read_text()
        return cls(hf, path)

    # text <-> ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters of its vocabulary string (a byte-level
        BPE's are one per byte): no token covers more characters of text, so a text of N
        characters is at least N / max_token_chars tokens, known before tokenizing it."""
        return max((len(t) for t in self.hf.get_vocab()), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # no clean-up: it rewrites " ." -> "." and would make decode lossy and non-incremental
        if skip_special_tokens and self._hidden_special is not None:
            # skip special tokens but a tool-call format's markers ([TOOL_CALLS],
            # <|python_tag|>, ...): the tool parser reads them (as vLLM keeps them for its
            # mistral / llama3_json parsers)
            ids = [i for i in ids if i not in self._hidden_special]
            skip_special_tokens = False
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @functools.cached_property
    def _hidden_special(self) -> frozenset[int] | None:
        """The special ids decode skips when a tool-call marker is itself a special token
        (None when none is: then skip_special_tokens skips exactly the same set)."""
        from shared.toolformats import MARKERS

        special = {i for i, t in getattr(self.hf, "added_tokens_decoder", {}).items()
                   if getattr(t, "special", False)}
        special |= set(self.hf.all_special_ids)
        kept = {i for i in special if self.hf.convert_ids_to_tokens(i) in MARKERS}
        return frozenset(special - kept) if kept else None

    # chat

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self.hf.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self._template_for(messages, tools),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        # the template writes any BOS itself; adding special tokens again would double it
        return self.encode(self.render_chat(messages, tools, add_generation_prompt),
                           add_special_tokens=False)

    @cached_property
    def model_template_renders_tools(self) -> bool:
        template = self.hf.chat_template
        return isinstance(template, str) and "tools" in template

    @cached_property
    def tool_format(self) -> str:
        """The tool-call format the template renders (shared/toolformats.py): the model's
        own when it renders tools, else the bundled Hermes tool template's."""
        from shared.toolformats import DEFAULT, detect

        if not self.model_template_renders_tools:
            return DEFAULT
        return detect(self.hf.chat_template)

    def _template_for(self, messages: list[dict], tools: list[dict] | None) -> str | None:
        """The model's own template, unless the conversation involves tools it cannot render
        (or it has none): then the Hermes/ChatML tool template."""
        if not self.hf.chat_template:
            return _tool_template()
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls")
                                        for m in messages)
        if uses_tools and not self.model_template_renders_tools:
            return _tool_template()
        return None

    # facts about the vocabulary

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        gen_eos = self._generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        vocab = self.hf.get_vocab()
        ids.update(vocab[t] for t in EXTRA_EOS_TOKENS if t in vocab)
        return frozenset(ids)

    @cached_property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (base vocab + added tokens); the model's embedding
        table may be padded larger."""
        return len(self.hf)

    @cached_property
    def context_length(self) -> int | None:
        config = self._model_config
        for source in (config, config.get("text_config") or {}):
            if source.get("max_position_embeddings"):
                return int(source["max_position_embeddings"])
        max_len = getattr(self.hf, "model_max_length", None)
        return int(max_len) if max_len and max_len < 10**8 else None  # HF uses ~1e30 for "unknown"

    @cached_property
    def fingerprint(self) -> str:
        return _fingerprint(self.hf)


class IncrementalDetokenizer:
    """Generated ids -> text, one token at a time.

    The prefix-offset / read-offset technique (vLLM, TGI): each step decodes a short window
    `ids[prefix_offset:]` and subtracts the already-emitted window `ids[prefix_offset:read_offset]`.
    Decoding a window rather than one token keeps context-dependent spacing (SentencePiece's
    leading "▁") right; holding back while the window ends in U+FFFD waits for the rest of a
    multi-byte UTF-8 character. The prompt's last few ids seed the window.
    """

    PROMPT_CONTEXT = 5  # prompt tokens decoded for context, never emitted

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(self._prefix_text) :])

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (bytes that never formed a
        character come out as U+FFFD, as a full decode shows them)."""
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(window_text[len(self._prefix_text) :])

    def _emit(self, new_text: str) -> str:
        # all ids so far are now text; the next window starts at the old read offset
        self._text_parts.append(new_text)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _tool_template() -> str:
    return TOOL_TEMPLATE.read_text()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _fingerprint(hf: Any) -> str:
    """sha256 over everything that maps text <-> ids: the backend's model (vocab, merges and
    their options), added/special tokens, normalizer, pre-tokenizer, post-processor, decoder,
    and which tokens are bos/eos/pad/unk. Canonical JSON, so equal across processes."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        model = dict(spec.get("model") or {})
        if isinstance(model.get("merges"), list):
            # tokenizers writes merges as "a b" or ["a", "b"] depending on version
            model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m)
                               for m in model["merges"]]
        state = {
            "model": model,
            "added_tokens": spec.get("added_tokens"),
            "normalizer": spec.get("normalizer"),
            "pre_tokenizer": spec.get("pre_tokenizer"),
            "post_processor": spec.get("post_processor"),
            "decoder": spec.get("decoder"),
        }
    else:  # a pure-Python tokenizer: the vocabulary is all we can see
        state = {"class": type(hf).__name__, "vocab": hf.get_vocab()}
    state["special_tokens"] = {
        name: getattr(hf, name, None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    blob = json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
