"""scripts/train_models.py --smoke builds both model folders end to end in seconds, and what it
writes loads with plain transformers and renders tools and tool calls in the chat template."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "units": {"type": "string", "enum": ["metric", "imperial"]}},
        "required": ["city"]}}}]


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-models")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_models.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=120)
    return out


@pytest.mark.timeout(120)
def test_smoke_writes_loadable_hf_folders(smoke_out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("tiny-target", "tiny-draft"):
        folder = smoke_out / name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json"):
            assert (folder / f).is_file(), f"{name}/{f} missing"
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = tok.encode("def fibonacci(n):\n", add_special_tokens=False)
        assert tok.decode(ids) == "def fibonacci(n):\n"
        logits = model(input_ids=torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), config["vocab_size"])
        gen = json.loads((folder / "generation_config.json").read_text())
        assert sorted(gen["eos_token_id"]) == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert (smoke_out / "eval.json").is_file() and (smoke_out / "README.md").is_file()


@pytest.mark.timeout(120)
def test_smoke_chat_template_renders_tools_and_tool_calls(smoke_out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smoke_out / "tiny-target")
    assert "chat_template" in json.loads((smoke_out / "tiny-target" / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")

    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    rendered = {}
    for args in (call["arguments"], json.dumps(call["arguments"])):  # object or JSON string
        history = messages + [
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "content": '{"temp": 21}'}]
        rendered[type(args)] = tok.apply_chat_template(history, tools=TOOLS, tokenize=False)
    assert rendered[dict] == rendered[str]
    text = rendered[dict]
    assert "<|im_start|>assistant\n<tool_call>\n" + json.dumps(call) + "\n</tool_call><|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n" in text

    ids = tok.apply_chat_template(history, tools=TOOLS, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert tok.convert_tokens_to_ids(tag) in ids, tag  # one token each, not split into bytes
    # tool tags survive skip_special_tokens (the gateway parses them from detokenized text)
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)
