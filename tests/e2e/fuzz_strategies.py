"""Hypothesis strategies for the body fuzzer (test_fuzz_bodies.py): the leaves every API
shares (junk values, JSON schemas), and (route, body) pairs shaped like
/v1/chat/completions and /v1/completions (`chat_request`), and /v1/responses,
/v1/messages (and count_tokens), /tokenize and /detokenize (`api_request`) — each a valid
body, or one with a field or two made wild: a wrong type, a null, a huge or negative
number, an odd content part or block, a tool with an odd schema.

The fields are those the APIs' parsers (services/gateway/apis/) read. PREV in a
previous_response_id is replaced, when sent, by the id of a response the fuzzer stored."""
from __future__ import annotations

from hypothesis import strategies as st

MODEL = "tiny-target"
PREV = "$PREV"                  # -> a stored response's id (test_fuzz_bodies.stored_id)

junk = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                 st.lists(st.integers(-5, 9000), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def ok_or_junk(ok):
    return st.one_of(ok, ok, ok, junk)


def wild(fields: dict) -> dict:
    """Each field's strategy, with junk mixed in."""
    return {k: st.one_of(v, v, junk) for k, v in fields.items()}


def mutated(valid, wild_fields: dict):
    """A valid body with one or two fields made wild (or one dropped)."""
    def one(body):
        return st.sampled_from(sorted(wild_fields)).flatmap(
            lambda k: st.one_of(wild_fields[k].map(lambda v: body | {k: v}),
                                st.just({x: y for x, y in body.items() if x != k})))
    return st.one_of(valid.flatmap(one), valid.flatmap(one).flatmap(one))


unit = st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0, 1e-9, -0.5, 1.5]))
small_float = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1e-6, 2.0, -2.0, 1e300, -1e300]))
max_tokens = st.one_of(st.integers(-2, 8), st.sampled_from([4096, 10 ** 9, 2 ** 63, -(2 ** 63)]))
token_id = st.one_of(st.integers(0, 8191), st.sampled_from([-1, 8192, 2 ** 40]))
text = st.text(max_size=80)
ok_text = st.text(min_size=1, max_size=60)
name = st.from_regex(r"[a-z_]{1,6}", fullmatch=True)

leaf_schema = st.sampled_from([
    {"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number"},
    {"type": "boolean"}, {"type": "null"}, {"enum": ["a", "b", 3]}, {"const": "x"},
    {"type": "string", "pattern": "^[a-z]{1,5}$"}, {"type": "string", "format": "date"},
    {"type": "string", "maxLength": 3}, {}, {"type": "array", "items": {"type": "integer"}},
    {"type": "object"}, {"type": "object", "additionalProperties": False},
    {"not": {"type": "string"}}, {"$ref": "#/$defs/x"}, {"type": "wat"}, {"uniqueItems": True},
    {"type": ["string", "null"]}, {"enum": []}, {"type": "integer", "minimum": 9, "maximum": 0},
    {"type": "string", "minLength": -1}, {"type": "array", "minItems": 5, "maxItems": 1},
    {"properties": None}, {"type": "object", "properties": []}, {"items": False},
    {"type": "string", "pattern": "("}, {"$defs": {"x": {"$ref": "#/$defs/x"}},
                                          "$ref": "#/$defs/x"}])
schema = st.recursive(leaf_schema, lambda kids: st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        name, kids, max_size=3)}, optional={"required": st.lists(name, max_size=2),
                                            "additionalProperties": st.one_of(st.booleans(),
                                                                              kids)}),
    st.fixed_dictionaries({"type": st.just("array"), "items": kids},
                          optional={"minItems": st.integers(0, 3)}),
    st.fixed_dictionaries({"anyOf": st.lists(kids, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"allOf": st.lists(kids, min_size=1, max_size=2)})), max_leaves=6)
ok_schema = st.recursive(st.sampled_from([
    {"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number"},
    {"type": "boolean"}, {"enum": ["a", "b", 3]}, {"type": "string", "maxLength": 3}]),
    lambda kids: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        name, kids, min_size=1, max_size=3)}), max_leaves=5)
ok_object_schema = ok_schema.filter(lambda x: x.get("type") == "object")
tool_name = st.one_of(st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True), text,
                      st.just("x" * 80))
arguments = st.one_of(text, st.just('{"a": 1}'), st.just("{"), st.just("[1]"),
                      st.dictionaries(st.text(max_size=3), st.integers()))
stop = st.one_of(text, st.lists(text, max_size=5), st.just(["x" * 600]), st.just([""]))


# ---- /v1/chat/completions, /v1/completions ----------------------------------------

tool = st.fixed_dictionaries({
    "type": ok_or_junk(st.just("function")),
    "function": st.fixed_dictionaries(
        {"name": st.one_of(st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True), text)},
        optional={"description": text, "parameters": st.one_of(schema, junk),
                  "strict": st.booleans()})})
tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}), junk)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "bogus"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {}, optional={"name": text, "schema": st.one_of(schema, junk), "strict": st.booleans()})}),
    junk)
call = st.fixed_dictionaries({
    "type": ok_or_junk(st.just("function")),
    "function": st.fixed_dictionaries({"name": text, "arguments": st.one_of(
        text, st.just('{"a": 1}'), st.dictionaries(st.text(max_size=3), st.integers()))})},
    optional={"id": text})
message = st.fixed_dictionaries(
    {"role": ok_or_junk(st.sampled_from(["system", "developer", "user", "assistant", "tool",
                                          "bogus"]))},
    optional={"content": st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": text}), max_size=2),
        junk),
        "name": text, "tool_calls": st.lists(call, max_size=2), "tool_call_id": text})

# every field: a wild value (out of range, wrong type, junk) ...
WILD = wild({
    "model": st.sampled_from([MODEL, "nope", ""]), "max_tokens": max_tokens,
    "temperature": small_float, "top_p": unit, "n": st.sampled_from([1, 2, 0, -1]),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(text, st.lists(text, max_size=5), st.just(["x" * 600])),
    "seed": st.integers(-(2 ** 65), 2 ** 65),
    "presence_penalty": small_float, "frequency_penalty": small_float,
    "logit_bias": st.dictionaries(st.one_of(token_id.map(str), text), small_float, max_size=4),
    "user": text, "top_k": st.integers(-2, 2 ** 40), "min_p": unit,
    "repetition_penalty": small_float, "min_tokens": st.integers(-1, 9),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(token_id, max_size=70),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(), "pdmesh_path": st.sampled_from(["pd", "elsewhere"]),
    "cache_salt": st.text(max_size=300), "max_completion_tokens": max_tokens,
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25), "tools": st.lists(tool, max_size=3),
    "tool_choice": tool_choice, "parallel_tool_calls": st.booleans(),
    "response_format": response_format, "functions": st.lists(junk, max_size=1),
    "function_call": junk, "echo": st.booleans(), "suffix": text,
    "best_of": st.sampled_from([1, 2]), "messages": st.lists(message, max_size=4),
    "prompt": st.one_of(text, st.lists(token_id, max_size=40), st.lists(text, max_size=2),
                        st.lists(st.lists(token_id, max_size=5), max_size=2))})

# ... and a valid one
ok_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                           st.fixed_dictionaries({
                                               "name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                                               "parameters": ok_schema.filter(
                                                   lambda x: x.get("type") == "object")})}),
                    min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])
VALID = {
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]), "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1),
    "seed": st.integers(0, 2 ** 63 - 1), "stop": st.lists(ok_text, max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 8191), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, 8191).map(str), st.floats(-100, 100),
                                  max_size=5),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "return_token_ids": st.booleans(),
    "pdmesh_path": st.sampled_from(["pd", "colocated"]), "stream": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=16), "user": ok_text, "n": st.just(1),
    "model": st.just(MODEL)}
ok_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "user"]),
                                    "content": ok_text})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(ok_message, min_size=1, max_size=3)},
    optional=VALID | {"logprobs": st.booleans(), "response_format": st.one_of(
        st.just({"type": "json_object"}), ok_schema.map(lambda x: {
            "type": "json_schema", "json_schema": {"name": "s", "schema": x}}))}
).flatmap(lambda b: st.just(b) if "response_format" in b else st.one_of(
    st.just(b), ok_tools.map(lambda t: b | {"tools": t, "tool_choice": "auto"})))
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(ok_text, st.lists(st.integers(0, 8191), min_size=1, max_size=40))},
    optional=VALID | {"logprobs": st.integers(0, 5)})


chat_body = st.one_of(valid_chat, mutated(valid_chat, WILD))
completion_body = st.one_of(valid_completion, mutated(valid_completion, WILD))
chat_request = st.one_of(chat_body.map(lambda b: ("/v1/chat/completions", b)),
                         completion_body.map(lambda b: ("/v1/completions", b)))


# ---- /v1/responses -----------------------------------------------------------------------

r_part = st.fixed_dictionaries(
    {"type": ok_or_junk(st.sampled_from(["input_text", "output_text", "text", "input_image",
                                         "refusal", "input_file"]))},
    optional={"text": ok_or_junk(text), "image_url": text, "annotations": junk})
r_content = st.one_of(text, st.lists(r_part, max_size=3), junk)
r_item = st.one_of(
    st.fixed_dictionaries({"role": ok_or_junk(st.sampled_from(
        ["user", "assistant", "system", "developer", "tool", "bogus"]))},
        optional={"type": st.sampled_from(["message", "bogus"]), "content": r_content,
                  "id": text, "status": text}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": ok_or_junk(text), "name": ok_or_junk(tool_name),
        "arguments": ok_or_junk(arguments), "id": text, "status": text}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": ok_or_junk(text), "output": r_content}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", ""])},
                          optional={"summary": junk, "id": text}),
    junk)
r_tool = st.fixed_dictionaries(
    {"type": ok_or_junk(st.sampled_from(["function", "function", "web_search", "mcp"]))},
    optional={"name": ok_or_junk(tool_name), "description": text,
              "parameters": st.one_of(schema, junk), "strict": ok_or_junk(st.booleans())})
r_tool_choice = st.one_of(
    st.sampled_from(["auto", "required", "none", "any", "bogus", ""]),
    st.fixed_dictionaries({"type": ok_or_junk(st.sampled_from(["function", "file_search"]))},
                          optional={"name": ok_or_junk(tool_name)}))
r_format = st.fixed_dictionaries(
    {"type": ok_or_junk(st.sampled_from(["json_schema", "json_object", "text", "bogus"]))},
    optional={"name": text, "description": text, "schema": st.one_of(schema, junk),
              "strict": st.booleans()})
R_WILD = wild({
    "model": st.sampled_from([MODEL, "nope", ""]), "input": st.one_of(
        text, st.lists(r_item, max_size=4)), "instructions": text,
    "tools": st.lists(r_tool, max_size=3), "tool_choice": r_tool_choice,
    "parallel_tool_calls": st.booleans(), "text": st.fixed_dictionaries(
        {}, optional={"format": st.one_of(r_format, junk), "verbosity": text}),
    "max_output_tokens": max_tokens, "temperature": small_float, "top_p": unit,
    "stream": st.booleans(), "store": st.booleans(),
    "previous_response_id": st.sampled_from([PREV, PREV, "resp_0", ""]),
    "metadata": st.dictionaries(st.text(max_size=8), text, max_size=3), "user": text,
    "truncation": st.sampled_from(["disabled", "auto"]), "top_logprobs": st.integers(-1, 25),
    "background": st.booleans(), "conversation": text, "prompt": junk,
    "seed": st.integers(-(2 ** 65), 2 ** 65), "top_k": st.integers(-2, 2 ** 40), "min_p": unit,
    "repetition_penalty": small_float, "stop": stop,
    "pdmesh_path": st.sampled_from(["pd", "colocated", "elsewhere"])})
ok_r_item = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system"]),
                                   "content": st.one_of(ok_text, st.lists(st.fixed_dictionaries(
                                       {"type": st.just("input_text"), "text": ok_text}),
                                       min_size=1, max_size=2))})
r_history = st.tuples(ok_text, name, st.just('{"a": 1}'), ok_text).map(lambda h: [
    {"role": "user", "content": h[0]},
    {"type": "function_call", "call_id": "call_1", "name": h[1], "arguments": h[2]},
    {"type": "function_call_output", "call_id": "call_1", "output": h[3]}])
valid_responses = st.fixed_dictionaries(
    {"input": st.one_of(ok_text, st.lists(ok_r_item, min_size=1, max_size=3), r_history),
     "max_output_tokens": st.integers(1, 6)},
    optional={"model": st.just(MODEL), "instructions": ok_text, "temperature": st.floats(0, 2),
              "top_p": st.floats(0.05, 1), "seed": st.integers(0, 2 ** 63 - 1),
              "stream": st.booleans(), "store": st.booleans(),
              "previous_response_id": st.just(PREV), "stop": st.lists(ok_text, max_size=3),
              "pdmesh_path": st.sampled_from(["pd", "colocated"]),
              "text": st.one_of(st.just({"format": {"type": "json_object"}}), ok_schema.map(
                  lambda x: {"format": {"type": "json_schema", "name": "s", "schema": x}})),
              "tools": st.lists(st.fixed_dictionaries({
                  "type": st.just("function"), "name": name, "parameters": ok_object_schema}),
                  min_size=1, max_size=2, unique_by=lambda t: t["name"]),
              "tool_choice": st.sampled_from(["auto", "required", "none"])})
responses_body = st.one_of(valid_responses, mutated(valid_responses, R_WILD))


# ---- /v1/messages ------------------------------------------------------------------------

a_inner = st.fixed_dictionaries({"type": ok_or_junk(st.sampled_from(["text", "image"]))},
                                optional={"text": ok_or_junk(text)})
a_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text")}, optional={
        "text": ok_or_junk(text), "cache_control": junk, "citations": junk}),
    st.fixed_dictionaries({"type": st.just("tool_use")}, optional={
        "id": ok_or_junk(text), "name": ok_or_junk(tool_name),
        "input": st.one_of(st.dictionaries(st.text(max_size=4), junk, max_size=3), junk)}),
    st.fixed_dictionaries({"type": st.just("tool_result")}, optional={
        "tool_use_id": ok_or_junk(text), "is_error": ok_or_junk(st.booleans()),
        "content": st.one_of(text, st.lists(a_inner, max_size=3), junk)}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image",
                                                    "document", "bogus"])},
                          optional={"thinking": text, "signature": text, "source": junk}),
    junk)
a_message = st.fixed_dictionaries({
    "role": ok_or_junk(st.sampled_from(["user", "assistant", "system", "tool"])),
    "content": st.one_of(text, st.lists(a_block, max_size=3), junk)})
a_tool = st.fixed_dictionaries(
    {"name": ok_or_junk(tool_name), "input_schema": st.one_of(schema, junk)},
    optional={"description": text, "type": st.sampled_from(["custom", "bash_20250124"]),
              "cache_control": junk})
a_tool_choice = st.fixed_dictionaries(
    {"type": ok_or_junk(st.sampled_from(["auto", "any", "tool", "none", "bogus"]))},
    optional={"name": ok_or_junk(tool_name), "disable_parallel_tool_use": st.booleans()})
A_WILD = wild({
    "model": st.sampled_from([MODEL, "nope", ""]), "max_tokens": max_tokens,
    "messages": st.lists(a_message, max_size=4),
    "system": st.one_of(text, st.lists(a_block, max_size=2)), "stop_sequences": stop,
    "stream": st.booleans(), "temperature": small_float, "top_p": unit,
    "top_k": st.integers(-2, 2 ** 40), "tools": st.lists(a_tool, max_size=3),
    "tool_choice": a_tool_choice, "metadata": st.fixed_dictionaries(
        {}, optional={"user_id": ok_or_junk(text)}),
    "thinking": st.fixed_dictionaries({"type": ok_or_junk(st.sampled_from(
        ["enabled", "disabled"]))}, optional={"budget_tokens": st.integers(-1, 2 ** 40)}),
    "output_config": st.fixed_dictionaries({}, optional={
        "format": st.one_of(st.fixed_dictionaries(
            {"type": ok_or_junk(st.sampled_from(["json_schema", "text"]))},
            optional={"schema": st.one_of(schema, junk)}), junk), "effort": text}),
    "service_tier": text, "seed": st.integers(-(2 ** 65), 2 ** 65),
    "pdmesh_path": st.sampled_from(["pd", "colocated", "elsewhere"])})
ok_a_message = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
    ok_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ok_text}),
                      min_size=1, max_size=2))})
a_history = st.tuples(ok_text, name, ok_text).map(lambda h: [
    {"role": "user", "content": h[0]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": h[1],
                                       "input": {"a": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": h[2]}]}])
valid_messages = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 6),
     "messages": st.one_of(a_history, st.lists(ok_a_message, min_size=1, max_size=2).flatmap(
         lambda ms: st.one_of(st.just(ms), ok_text.map(
             lambda t: ms + [{"role": "assistant", "content": t}]))))},
    optional={"system": ok_text, "temperature": st.floats(0, 1), "top_p": st.floats(0.05, 1),
              "top_k": st.integers(0, 50), "seed": st.integers(0, 2 ** 63 - 1),
              "stream": st.booleans(), "stop_sequences": st.lists(ok_text, max_size=3),
              "pdmesh_path": st.sampled_from(["pd", "colocated"]),
              "tools": st.lists(st.fixed_dictionaries(
                  {"name": name, "input_schema": ok_object_schema}), min_size=1, max_size=2,
                  unique_by=lambda t: t["name"]),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"},
                                              {"type": "any"}]),
              "output_config": ok_object_schema.map(
                  lambda x: {"format": {"type": "json_schema", "schema": x}})})
messages_body = st.one_of(valid_messages, mutated(valid_messages, A_WILD))


# ---- /tokenize, /detokenize --------------------------------------------------------------

T_WILD = wild({
    "model": st.sampled_from([MODEL, "nope", ""]), "prompt": text,
    "messages": st.lists(message, max_size=4), "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "return_token_strs": st.booleans(), "tools": st.lists(tool, max_size=3),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(
        ["enable_thinking", "add_generation_prompt", "tools", "messages", "x"]), junk,
        max_size=2)})
ok_chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                          "content": ok_text}), min_size=1, max_size=3)
valid_tokenize = st.one_of(
    st.fixed_dictionaries({"prompt": ok_text}, optional={
        "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
        "model": st.just(MODEL)}),
    st.fixed_dictionaries({"messages": ok_chat}, optional={
        "add_generation_prompt": st.booleans(), "return_token_strs": st.booleans(),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                                 st.fixed_dictionaries({
                                                     "name": name,
                                                     "parameters": ok_object_schema})}),
                          max_size=2)}))
tokenize_body = st.one_of(valid_tokenize, mutated(valid_tokenize, T_WILD))
valid_detokenize = st.fixed_dictionaries(
    {"tokens": st.lists(st.integers(0, 8191), min_size=1, max_size=20)},
    optional={"model": st.just(MODEL)})
# hypothesis favours the simple branches (junk, []): valid bodies twice over, so that some
# of every batch are served (test_the_fuzzer_sent_enough_and_the_mesh_is_healthy)
detokenize_body = st.one_of(valid_detokenize, valid_detokenize, st.fixed_dictionaries(
    {"tokens": st.one_of(st.lists(st.integers(0, 8191), max_size=20),
                         st.lists(token_id, max_size=20), junk)},
    optional={"model": st.sampled_from([MODEL, MODEL, "nope"])}))

api_request = st.one_of(
    responses_body.map(lambda b: ("/v1/responses", b)),
    messages_body.map(lambda b: ("/v1/messages", b)),
    messages_body.map(lambda b: ("/v1/messages/count_tokens", b)),
    tokenize_body.map(lambda b: ("/tokenize", b)),
    detokenize_body.map(lambda b: ("/detokenize", b)))
