"""A text that cannot fit the context window is refused before it is tokenized (issue 29:
an 8 MiB body cost ~5 s of the gateway's one tokenizer thread before its 400, and three of
them made another tenant's request take 20.9 s instead of 0.12 s)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from services.gateway.protocol import OpenAIError
from services.gateway.validate import parse_chat, parse_completion


class Counting:
    """The real tokenizer, counting the texts it was asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        if name in ("encode", "encode_chat"):
            self.calls += 1
        return getattr(self.inner, name)


@pytest.fixture
def counted(spec):
    return dataclasses.replace(spec, tokenizer=Counting(spec.tokenizer))


def test_an_oversized_prompt_is_refused_untokenized(counted):
    limit = counted.max_model_len * counted.tokenizer.max_token_chars
    for body in ({"prompt": "x" * (8 << 20), "max_tokens": 1},
                 {"prompt": "x" * (limit + 1), "max_tokens": 1}):
        with pytest.raises(OpenAIError) as e:
            parse_completion(json.dumps(body).encode(), counted)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "y" * (limit // 2)},
                         {"role": "user", "content": "z" * (limit // 2 + 10)}]}
    with pytest.raises(OpenAIError) as e:
        parse_chat(json.dumps(chat).encode(), counted)
    assert e.value.code == "context_length_exceeded" and "characters" in e.value.message
    assert counted.tokenizer.calls == 0              # refused before any tokenizing


def test_a_prompt_within_the_budget_is_tokenized_and_judged_by_its_tokens(counted):
    ok = parse_completion(json.dumps({"prompt": "hello " * 50, "max_tokens": 4}).encode(),
                          counted)
    assert len(ok.prompt_ids) > 0 and counted.tokenizer.calls == 1
    n = counted.max_model_len * 2           # fits the character budget, not the window
    with pytest.raises(OpenAIError) as e:
        parse_completion(json.dumps({"prompt": "hello " * n, "max_tokens": 1}).encode(),
                         counted)
    assert e.value.code == "context_length_exceeded" and "tokens" in e.value.message
    assert counted.tokenizer.calls == 2
