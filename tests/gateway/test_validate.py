"""Request validation is pure: malformed bodies get an OpenAI error (status, param, a message
naming the problem) and good bodies become the right prompt ids and SamplingParams."""
from __future__ import annotations

import json

import pytest

from services.gateway.protocol import OpenAIError
from services.gateway.validate import parse_chat, parse_completion

MSGS = [{"role": "user", "content": "Say hi."}]


def chat(**kw) -> bytes:
    return json.dumps({"messages": MSGS} | kw).encode()


def cmpl(**kw) -> bytes:
    return json.dumps({"prompt": "def add(a, b):"} | kw).encode()


def err(parse, body: bytes, spec) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, spec)
    e = info.value
    shape = e.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == ("invalid_request_error" if e.status < 500 else "server_error")
    return e


# (parse, body, status, param, words the message must contain)
BAD = [
    (parse_chat, b"{not json", 400, None, "not valid JSON"),
    (parse_chat, b"", 400, None, "not valid JSON"),
    (parse_chat, b"[1, 2]", 400, None, "JSON object"),
    (parse_chat, b'"hello"', 400, None, "JSON object"),
    (parse_chat, b"{}", 400, "messages", "required"),
    (parse_chat, chat(messages=[]), 400, "messages", "at least one"),
    (parse_chat, chat(messages="hi"), 400, "messages", "Expected `array`"),
    (parse_chat, chat(temperature="hot"), 400, "temperature", "float"),
    (parse_chat, chat(max_tokens=1.5), 400, "max_tokens", "int"),
    (parse_chat, chat(stream="yes"), 400, "stream", "bool"),
    (parse_chat, chat(messages=[{"role": "bot", "content": "x"}]), 400, "messages[0].role", "bot"),
    (parse_chat, chat(messages=[{"content": "x"}]), 400, "messages[0].role", "required"),
    (parse_chat, chat(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content",
     "int"),
    (parse_chat, chat(messages=[{"role": "user"}]), 400, "messages[0].content", "required"),
    (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type", "image_url"),
    (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content[0].text", "required"),
    (parse_chat, chat(model="gpt-4o"), 404, "model", "gpt-4o"),
    (parse_chat, chat(n=0), 400, "n", "'n'"),
    (parse_chat, chat(n=17), 400, "n", "[1, 16]"),
    (parse_chat, chat(max_tokens=0), 400, "max_tokens", "at least 1"),
    (parse_chat, chat(max_completion_tokens=-3), 400, "max_completion_tokens", "at least 1"),
    (parse_chat, chat(temperature=2.5), 400, "temperature", "temperature"),
    (parse_chat, chat(top_p=0), 400, "top_p", "top_p"),
    (parse_chat, chat(top_p=1.5), 400, "top_p", "top_p"),
    (parse_chat, chat(presence_penalty=3), 400, "presence_penalty", "presence_penalty"),
    (parse_chat, chat(logit_bias={"abc": 1}), 400, "logit_bias", "abc"),
    (parse_chat, chat(logit_bias={"10000000": 1}), 400, "logit_bias", "10000000"),
    (parse_chat, chat(logit_bias={"5": 500}), 400, "logit_bias", "[-100, 100]"),
    (parse_chat, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    (parse_chat, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "top_logprobs"),
    (parse_chat, chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    (parse_chat, chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), 400, "tools[0].function.name", "a-z"),
    (parse_chat, chat(tool_choice="required"), 400, "tool_choice", "no 'tools'"),
    (parse_chat, chat(response_format={"type": "yaml"}), 400, "response_format.type", "yaml"),
    (parse_chat, chat(functions=[{"name": "f"}]), 400, "functions", "functions"),
    (parse_chat, chat(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
    (parse_chat, chat(min_tokens=20, max_tokens=10), 400, "min_tokens", "min_tokens"),
    (parse_chat, chat(stop_token_ids=[-1]), 400, "stop_token_ids", "out of range"),
    (parse_chat, chat(seed=1 << 70), 400, "seed", "64 bits"),
    (parse_completion, b"{}", 400, "prompt", "required"),
    (parse_completion, cmpl(prompt=""), 400, "prompt", "empty"),
    (parse_completion, cmpl(prompt=[]), 400, "prompt", "empty"),
    (parse_completion, cmpl(prompt=["a", "b"]), 400, "prompt", "batch"),
    (parse_completion, cmpl(prompt=[[1, 2], [3]]), 400, "prompt", "batch"),
    (parse_completion, cmpl(prompt=[1, "a"]), 400, "prompt", "token ids"),
    (parse_completion, cmpl(prompt={"text": "x"}), 400, "prompt", "string"),
    (parse_completion, cmpl(prompt=[5, 10_000_000]), 400, "prompt", "10000000"),
    (parse_completion, cmpl(prompt=[5, -1]), 400, "prompt", "out of range"),
    (parse_completion, cmpl(echo=True), 400, "echo", "echo"),
    (parse_completion, cmpl(suffix="}"), 400, "suffix", "suffix"),
    (parse_completion, cmpl(best_of=3), 400, "best_of", "best_of"),
    (parse_completion, cmpl(logprobs=30), 400, "logprobs", "logprobs"),
    (parse_completion, cmpl(max_tokens=0), 400, "max_tokens", "at least 1"),
    (parse_completion, cmpl(model="other"), 404, "model", "other"),
]


@pytest.mark.parametrize("parse,body,status,param,words", BAD,
                         ids=[f"{i}-{b[:40]!r}" for i, (_p, b, *_r) in enumerate(BAD)])
def test_malformed_body_gets_openai_error_naming_the_problem(spec, parse, body, status, param,
                                                             words):
    e = err(parse, body, spec)
    assert e.status == status
    assert e.param == param
    assert words.lower() in e.message.lower(), e.message


def test_unknown_model_is_404_model_not_found(spec):
    e = err(parse_chat, chat(model="nope"), spec)
    assert (e.status, e.code) == (404, "model_not_found")


def test_prompt_plus_max_tokens_over_window_names_both_numbers_and_window(spec):
    n_prompt = len(spec.tokenizer.encode_chat(MSGS))
    ask = spec.max_model_len - n_prompt + 1
    e = err(parse_chat, chat(max_tokens=ask), spec)
    assert e.code == "context_length_exceeded"
    for number in (spec.max_model_len, n_prompt, ask, n_prompt + ask):
        assert str(number) in e.message
    ids = [5] * spec.max_model_len
    e = err(parse_completion, cmpl(prompt=ids), spec)
    assert str(spec.max_model_len) in e.message and e.code == "context_length_exceeded"


def test_prompt_that_fills_the_window_leaves_no_room_for_chat(spec):
    long = "hello " * spec.max_model_len
    e = err(parse_chat, chat(messages=[{"role": "user", "content": long}]), spec)
    assert e.param == "messages" and str(spec.max_model_len) in e.message


def test_chat_body_becomes_sampling_params(spec):
    body = chat(model=spec.name, temperature=0.7, top_p=0.9, max_tokens=12, stop="END", seed=42,
                presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": -100, "11": 2.5},
                logprobs=True, top_logprobs=3, top_k=40, min_p=0.05, repetition_penalty=1.1,
                min_tokens=2, ignore_eos=True, stop_token_ids=[3], user="u1",
                skip_special_tokens=False, some_future_field={"x": 1})
    p = parse_chat(body, spec)
    assert p.prompt_ids == spec.tokenizer.encode_chat(MSGS)
    sp = p.params
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.7, 0.9, 12, 42)
    assert sp.stop == ("END",) and sp.stop_token_ids == (3,)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.5)
    assert sp.logit_bias == {7: -100.0, 11: 2.5}
    assert sp.logprobs == 3
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (40, 0.05, 1.1)
    assert (sp.min_tokens, sp.ignore_eos) == (2, True)
    assert p.options.chat and not p.options.stream and p.options.logprobs


def test_chat_defaults(spec):
    p = parse_chat(chat(), spec)
    sp = p.params
    assert sp.seed is None            # resolved at dispatch
    assert sp.logprobs is None and sp.temperature == 1.0 and sp.top_k == 0
    # the window's remainder (vLLM's chat default), capped by the gateway's default_max_tokens
    assert sp.max_tokens == min(spec.max_model_len - len(p.prompt_ids), spec.default_max_tokens)


def test_max_completion_tokens_wins_and_top_k_minus_one_is_off(spec):
    sp = parse_chat(chat(max_tokens=50, max_completion_tokens=5, top_k=-1), spec).params
    assert sp.max_tokens == 5 and sp.top_k == 0


def test_content_parts_roles_and_harmless_tool_fields_are_accepted(spec):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Say"},
                                         {"type": "text", "text": "hi."}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    p = parse_chat(chat(messages=msgs, tools=[], tool_choice="none",
                        response_format={"type": "text"}), spec)
    assert p.prompt_ids
    text = spec.tokenizer.decode(p.prompt_ids)
    assert "Say\nhi." in text and "Be brief." in text


def test_stream_options(spec):
    o = parse_chat(chat(stream=True, stream_options={"include_usage": True}), spec).options
    assert o.stream and o.include_usage
    o = parse_chat(chat(stream=True), spec).options
    assert o.stream and not o.include_usage


def test_completion_prompt_forms(spec):
    text = parse_completion(cmpl(), spec)
    assert text.prompt_ids == spec.tokenizer.encode("def add(a, b):", add_special_tokens=True)
    assert text.params.max_tokens == 16 and not text.options.chat
    assert parse_completion(cmpl(prompt=["def add(a, b):"]), spec).prompt_ids == text.prompt_ids
    assert parse_completion(cmpl(prompt=[1, 2, 3]), spec).prompt_ids == [1, 2, 3]
    assert parse_completion(cmpl(prompt=[[4, 5]]), spec).prompt_ids == [4, 5]
    p = parse_completion(cmpl(logprobs=0, max_tokens=3, echo=False, suffix=None), spec)
    assert p.params.logprobs == 0 and p.options.logprobs and p.params.max_tokens == 3
