"""Tokenizer wrapper on the SmolLM2 tokenizer: fingerprint, eos set, chat and tool
templates, incremental detokenization."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared.engine.tokenizer import IncrementalDetokenizer, Tokenizer

IM_START, IM_END, ENDOFTEXT = 1, 2, 0  # SmolLM2 special ids

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Grüße aus Köln, naïve café, Ελληνικά, русский текст, עברית, العربية",
    "日本語のテキストと中文文本，한국어 텍스트도",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces\n\ttabs\r\nand   runs   of spaces  ",
    "def f(x):\n    return x ** 2  # ∑ ≤ ≥ → ←",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER_ASKS = [{"role": "user", "content": "Weather in Paris and Zürich?"}]
TOOL_CONVERSATION = USER_ASKS + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "12°C, rain"},
]


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2)


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt if prompt is not None else [], **kw)
    pieces = [detok.step(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


# fingerprint


def test_fingerprint_is_stable_across_loads_and_processes(tok, smollm2):
    assert tok.fingerprint == Tokenizer.from_pretrained(smollm2).fingerprint
    code = (
        "import sys; from shared.engine.tokenizer import Tokenizer; "
        "print(Tokenizer.from_pretrained(sys.argv[1]).fingerprint)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(smollm2)], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == tok.fingerprint


def test_fingerprint_differs_when_a_token_is_added(tok, smollm2, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2)
    hf.add_tokens(["<pdmesh_probe>"])
    hf.save_pretrained(tmp_path)
    other = Tokenizer.from_pretrained(tmp_path)
    assert other.vocab_size == tok.vocab_size + 1
    assert other.fingerprint != tok.fingerprint


def test_fingerprint_differs_when_special_token_changes(tok, smollm2):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2)
    hf.eos_token = "<|endoftext|>"
    assert Tokenizer(hf).fingerprint != tok.fingerprint


# vocabulary facts


def test_eos_ids_vocab_and_context(tok):
    assert tok.hf.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == frozenset({IM_END, ENDOFTEXT})
    assert tok.vocab_size == 49152
    assert tok.context_length == 8192


def test_encode_decode_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


# incremental detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tok, text):
    prompt = tok.encode_chat([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text)
    pieces = stream(tok, ids, prompt)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    pieces = stream(tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "😀" and pieces[-1] == ""


def test_flush_releases_bytes_that_never_complete(tok):
    partial = tok.encode("😀")[:1]
    pieces = stream(tok, partial)
    assert pieces[0] == "" and pieces[-1] == tok.decode(partial) == "\ufffd"


def test_special_tokens_hidden_unless_asked(tok):
    ids = tok.encode("Paris.") + [IM_END]
    assert "".join(stream(tok, ids)) == "Paris."
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "Paris.<|im_end|>"


def test_incremental_detokenizer_on_generated_style_stream(tok):
    """A whole assistant reply including a tool call, decoded token by token after a chat
    prompt, reproduces the full decode."""
    reply = 'Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call> 🌧️'
    ids = tok.encode(reply)
    assert "".join(stream(tok, ids, tok.encode_chat(USER_ASKS, [WEATHER_TOOL]))) == reply


# chat templates


def test_plain_chat_uses_the_models_template(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.render_chat(messages)
    assert text == tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text) and ids[0] == IM_START and ids[1] != IM_START


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_tool_template_without_tools_matches_smollm2_template(tok, system):
    from shared.engine.tokenizer import _tool_template

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    for gen in (True, False):
        ours = tok.hf.apply_chat_template(
            messages, chat_template=_tool_template(), add_generation_prompt=gen, tokenize=False
        )
        assert ours == tok.hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_tool_template_describes_tools_in_system_turn(tok):
    text = tok.render_chat(USER_ASKS, [WEATHER_TOOL])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    tools_json = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools_json) == WEATHER_TOOL
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert text.endswith("<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_template_keeps_a_given_system_prompt(tok):
    text = tok.render_chat([{"role": "system", "content": "You are terse."}] + USER_ASKS, [WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "SmolLM" not in text


def test_tool_template_renders_tool_calls_and_responses(tok):
    text = tok.render_chat(TOOL_CONVERSATION, [WEATHER_TOOL])
    assistant = (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        "<|im_end|>\n"
    )
    responses = (
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12°C, rain\n</tool_response><|im_end|>\n"
    )
    assert text.endswith(assistant + responses + "<|im_start|>assistant\n")
    for call in text.split("<tool_call>\n")[2:]:
        json.loads(call.split("\n</tool_call>")[0])


def test_tool_messages_without_tools_still_use_tool_template(tok):
    text = tok.render_chat(TOOL_CONVERSATION)
    assert "<tools>" not in text
    assert "<tool_response>\n18°C, sunny\n</tool_response>" in text


def test_assistant_text_before_tool_call(tok):
    messages = USER_ASKS + [{
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": ""}}],
    }]
    text = tok.render_chat(messages, [WEATHER_TOOL], add_generation_prompt=False)
    assert text.endswith(
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {}}'
        "\n</tool_call><|im_end|>\n"
    )


def test_model_template_that_renders_tools_is_kept(smollm2):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2)
    hf.chat_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    own = Tokenizer(hf)
    assert own.render_chat(USER_ASKS, [WEATHER_TOOL]) == "[get_weather]Weather in Paris and Zürich?"
