"""The pure side of the newer APIs (no NATS, no decode): generation_config.json sampling
defaults and the default token cap, the Responses and Messages bodies translated onto the
chat path (prompt ids, SamplingParams, Constraint), their errors in each API's terms,
/tokenize and /detokenize, the response store's LRU bound, and `pdmesh up`'s default model."""
from __future__ import annotations

import json
import shutil

import msgspec
import pytest

from services.gateway.apis.messages import parse_messages
from services.gateway.apis.messages_out import error_body
from services.gateway.apis.responses import parse_responses
from services.gateway.apis.store import ResponseStore
from services.gateway.apis.tokenize import detokenize, tokenize
from services.gateway.config import GatewayConfig
from services.gateway.defaults import load_generation_defaults
from services.gateway.model import ModelSpec
from services.gateway.protocol import OpenAIError
from services.gateway.validate import parse_chat, parse_completion
from shared.contracts.constraint import ConstraintKind
from shared.settings import load
from tests.conftest import TINY_TARGET

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def enc(obj) -> bytes:
    return json.dumps(obj).encode()


def no_store(_rid):
    return None


@pytest.fixture
def card_model(tmp_path):
    """The tiny model's tokenizer with SmolLM2's model-card sampling defaults."""
    folder = tmp_path / "card"
    shutil.copytree(TINY_TARGET, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(
        gen | {"do_sample": True, "temperature": 0.2, "top_p": 0.9}))
    return folder


# ---- sampling defaults -------------------------------------------------------------------


def test_generation_config_defaults_apply_to_omitted_fields(card_model):
    spec = ModelSpec.load(GatewayConfig(model=str(card_model)))
    assert spec.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    sp = parse_chat(enc({"messages": USER}), spec).params
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.2, 0.9, 0)
    assert sp.max_tokens == spec.default_max_tokens == 512               # the documented cap
    sp = parse_chat(enc({"messages": USER, "temperature": 0.7, "top_p": 1.0}), spec).params
    assert (sp.temperature, sp.top_p) == (0.7, 1.0)                      # the request wins
    sp = parse_completion(enc({"prompt": "def f():"}), spec).params
    assert (sp.temperature, sp.max_tokens) == (0.2, 16)                  # OpenAI's 16 stays
    r = parse_responses(enc({"input": "hi"}), spec, no_store).prep.params
    assert (r.temperature, r.max_tokens) == (0.2, 512)
    m = parse_messages(enc({"model": spec.name, "max_tokens": 9, "messages": USER}), spec)
    assert (m.prep.params.temperature, m.prep.params.max_tokens) == (0.2, 9)


def test_no_generation_config_and_the_cap_flags(card_model):
    cfg = load(GatewayConfig, ["--model", str(card_model), "--no-generation-config",
                               "--default-max-tokens", "0"])
    spec = ModelSpec.load(cfg)
    sp = parse_chat(enc({"messages": USER}), spec).params
    assert (sp.temperature, sp.top_p) == (1.0, 1.0)
    p = parse_chat(enc({"messages": USER}), spec)
    assert p.params.max_tokens == spec.max_model_len - len(p.prompt_ids)   # no cap: vLLM's


def test_generation_config_values_checked_and_max_new_tokens(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 7, "top_p": 0.5, "top_k": -1, "min_p": "x", "repetition_penalty": 1.1,
        "max_new_tokens": 64}))
    defaults, cap = load_generation_defaults(tmp_path)
    assert defaults == {"top_p": 0.5, "top_k": 0, "repetition_penalty": 1.1} and cap == 64
    (tmp_path / "generation_config.json").write_text("[not an object")
    assert load_generation_defaults(tmp_path) == ({}, None)


# ---- Responses ---------------------------------------------------------------------------


def test_responses_items_become_chat_messages(spec):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
             {"type": "reasoning", "summary": []}]
    job = parse_responses(enc({"input": items, "instructions": "Be brief.", "tools": [
        {"type": "function", "name": "get_weather", "parameters": CITY}],
        "tool_choice": "required", "max_output_tokens": 20, "stream": True}), spec, no_store)
    chat = parse_chat(enc({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        "tool_choice": "required", "max_tokens": 20}), spec)
    assert job.prep.prompt_ids == chat.prompt_ids and job.stream
    assert job.prep.constraint == chat.constraint
    assert job.prep.constraint.kind is ConstraintKind.TOOLS_REQUIRED
    assert job.prep.params == chat.params and job.prep.options.tool_calls
    assert [m.role for m in job.ctx.history] == ["user", "assistant", "tool"]   # no system


def test_previous_response_id_prepends_the_stored_conversation(spec):
    first = parse_responses(enc({"input": "hi"}), spec, no_store)
    store = ResponseStore(4)
    store.put("resp_1", {}, first.ctx.history)
    cont = parse_responses(enc({"input": "again", "previous_response_id": "resp_1"}), spec,
                           store.history)
    assert [m.content for m in cont.ctx.history] == ["hi", "again"]
    assert cont.prep.prompt_ids[:len(first.prep.prompt_ids) - 3] == \
        first.prep.prompt_ids[:len(first.prep.prompt_ids) - 3]
    with pytest.raises(OpenAIError) as info:
        parse_responses(enc({"input": "x", "previous_response_id": "resp_2"}), spec,
                        store.history)
    assert info.value.status == 404 and info.value.param == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "object", "not": {}}}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "pdmesh_path": "moon"}, "pdmesh_path"),
])
def test_responses_errors_name_responses_fields(spec, body, param):
    with pytest.raises(OpenAIError) as info:
        parse_responses(enc(body), spec, no_store)
    e = info.value
    assert e.status == 400 and e.param == param, e
    assert "messages" not in e.message and "response_format" not in e.message, e


# ---- Messages ----------------------------------------------------------------------------


def test_messages_blocks_tools_and_choice(spec):
    body = {"model": spec.name, "max_tokens": 32, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"], "temperature": 0,
            "tools": [{"name": "get_weather", "input_schema": CITY}],
            "tool_choice": {"type": "tool", "name": "get_weather",
                            "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Let me check."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                              "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1",
                              "content": [{"type": "text", "text": "18C"}]},
                             {"type": "text", "text": "And tomorrow?"}]}]}
    job = parse_messages(enc(body), spec)
    c = job.prep.constraint
    assert c.kind is ConstraintKind.TOOL_NAMED and c.tool_name == "get_weather"
    assert c.parallel_tool_calls is False
    assert job.prep.params.stop == ("\n\n",) and job.ctx.stop_sequences == ("\n\n",)
    text = spec.tokenizer.decode(job.prep.prompt_ids)
    assert "Be brief." in text and "18C" in text and "And tomorrow?" in text
    assert text.index("18C") < text.index("And tomorrow?")
    kinds = {"auto": ConstraintKind.TOOLS_AUTO, "any": ConstraintKind.TOOLS_REQUIRED,
             "none": ConstraintKind.NONE}
    for choice, kind in kinds.items():
        b = body | {"tool_choice": {"type": choice}}
        assert parse_messages(enc(b), spec).prep.constraint.kind is kind


def test_messages_prefill_ends_the_prompt_with_the_assistant_text(spec):
    base = {"model": spec.name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    plain = parse_messages(enc(base), spec).prep.prompt_ids
    pre = parse_messages(enc(base | {"messages": base["messages"] + [
        {"role": "assistant", "content": "Hello"}]}), spec).prep.prompt_ids
    assert pre[:len(plain)] == plain
    assert spec.tokenizer.decode(pre[len(plain):]) == "Hello"


@pytest.mark.parametrize("body,status,words", [
    ({"max_tokens": 5, "messages": USER}, 400, "model"),
    ({"model": "tiny-target", "messages": USER}, 400, "max_tokens"),
    ({"model": "tiny-target", "max_tokens": 5, "messages": USER, "temperature": 1.2}, 400,
     "temperature"),
    ({"model": "claude-x", "max_tokens": 5, "messages": USER}, 404, "claude-x"),
    ({"model": "tiny-target", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, 400, "document"),
    ({"model": "tiny-target", "max_tokens": 5, "messages": USER,
      "thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "thinking"),
    ({"model": "tiny-target", "max_tokens": 5, "messages": USER,
      "tools": [{"name": "f", "input_schema": CITY}], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": CITY}}}, 400,
     "output_config.format"),
])
def test_messages_errors(spec, body, status, words):
    body = json.loads(json.dumps(body).replace("tiny-target", spec.name))
    with pytest.raises(OpenAIError) as info:
        parse_messages(enc(body), spec)
    e = info.value
    assert e.status == status and words in e.message, e
    shape = error_body(e)
    assert shape["type"] == "error" and set(shape["error"]) == {"type", "message"}
    assert shape["error"]["type"] == ("not_found_error" if status == 404
                                      else "invalid_request_error")


# ---- tokenize, store, CLI ----------------------------------------------------------------


def test_tokenize_matches_the_chat_prompt_and_detokenize_inverts(spec):
    body = {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": CITY}}], "return_token_strs": True}
    out = tokenize(enc(body), spec)
    chat = parse_chat(enc({"messages": USER, "tools": body["tools"]}), spec)
    assert out["tokens"] == chat.prompt_ids and out["count"] == len(chat.prompt_ids)
    assert out["max_model_len"] == spec.max_model_len and len(out["token_strs"]) == out["count"]
    ids = tokenize(enc({"prompt": "def f():"}), spec)["tokens"]
    assert detokenize(enc({"tokens": ids}), spec)["prompt"].endswith("def f():")
    cont = tokenize(enc({"messages": USER + [{"role": "assistant", "content": "It is"}],
                         "add_generation_prompt": False, "continue_final_message": True}), spec)
    assert spec.tokenizer.decode(cont["tokens"]).endswith("It is")
    for bad, param in (({"prompt": "x", "messages": USER}, "prompt"), ({}, "messages"),
                       ({"messages": USER, "continue_final_message": True}, None)):
        with pytest.raises(OpenAIError) as info:
            tokenize(enc(bad), spec)
        assert info.value.status == 400 and (param is None or info.value.param == param)
    with pytest.raises(OpenAIError) as info:
        detokenize(enc({"tokens": [spec.vocab_size]}), spec)
    assert info.value.param == "tokens"
    with pytest.raises(OpenAIError):
        detokenize(enc({"tokens": ["a"]}), spec)


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(2)
    store.put("a", {"id": "a"}, [1])
    store.put("b", {"id": "b"}, [2])
    assert store.history("a") == [1]          # a is now the most recent
    store.put("c", {"id": "c"}, [3])
    assert store.response("b") is None and store.response("a") == {"id": "a"}
    assert len(store) == 2 and store.evictions == 1
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(0)
    off.put("x", {}, [])
    assert off.history("x") is None


def test_pdmesh_up_defaults_to_the_converted_default_model(smollm2, monkeypatch):
    from pdmesh import cli
    from pdmesh.local import up

    assert cli.build_parser().parse_args(["up"]).model is None
    monkeypatch.setenv("PDMESH_SMOLLM2_DIR", str(smollm2))
    assert up._default_model() == str(smollm2)
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    assert (gen["temperature"], gen["top_p"]) == (0.2, 0.9)     # the model card's defaults
    assert msgspec.json.decode((smollm2 / "config.json").read_bytes())["model_type"] == "llama"
