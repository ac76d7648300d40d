"""Grammar constraints (shared/engine/grammar): every kind, random-walked under its mask, ends
in output that parses and validates; replay, rollback and draft masks reproduce the state;
special tokens, padded vocabularies, the cache and refusals.

Tokenizers: SmolLM2 (tool tags are several plain tokens), a small byte-level BPE built here
whose tool tags are single added tokens (what models/tiny-target has), and tiny-target itself
when it has been trained.
"""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from shared.contracts.constraint import Constraint, ConstraintKind as K
from shared.engine.grammar import (
    ConstraintError,
    ConstraintState,
    GrammarCompiler,
    ReplayError,
    build_grammar,
)
from shared.engine.grammar.state import pack_mask, unpack_bitmask
from shared.engine.tokenizer import Tokenizer
from shared.toolcalls import parse_tool_calls
from tests.conftest import TINY_TARGET

# schemas: nested objects, enums, arrays, optional fields, anyOf/null, $ref recursion
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "units": {"enum": ["metric", "imperial"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city"]}
PERSON = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["name", "age"]},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"]},
    "active": {"type": "boolean"}},
    "required": ["user"]}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {
            "sku": {"type": "string", "enum": ["A-1", "B-2", "C-3"]},
            "qty": {"type": "number", "minimum": 0, "maximum": 1000},
            "gift": {"type": "boolean"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[a-z0-9]{1,6}$"}},
        "required": ["sku", "qty"]}},
    "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    "priority": {"type": "string", "enum": ["low", "high"]},
    "version": {"const": 2}},
    "required": ["items", "version"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["value"]}},
    "$ref": "#/$defs/node"}
SCHEMAS = {"weather": WEATHER, "person": PERSON, "order": ORDER, "tree": TREE}


def fn(name, params=None):
    f = {"name": name, "description": f"the {name} tool"}
    if params is not None:
        f["parameters"] = params
    return {"type": "function", "function": f}


TOOLS = [fn("get_weather", WEATHER), fn("save_person", PERSON), fn("place_order", ORDER), fn("ping")]
TOOLS_JSON = json.dumps(TOOLS)
TOOL_SCHEMAS = {"get_weather": WEATHER, "save_person": PERSON, "place_order": ORDER,
                "ping": {"type": "object", "properties": {}}}


# tokenizers

SPECIAL_TAGS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                ("<tool_call>", False), ("</tool_call>", False)]


def special_tag_tokenizer() -> Tokenizer:
    """Byte-level BPE like tiny-target's: tool tags are single (non-special) added tokens."""
    from tokenizers import (
        Regex,
        Tokenizer as RawTokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    split = Regex(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    corpus = [json.dumps(s) for s in SCHEMAS.values()] + [
        '{"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}',
        "def main():\n    return 1\n", "Hello world, the weather is nice today."]
    raw.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=700, special_tokens=[t for t, _ in SPECIAL_TAGS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    spec = json.loads(raw.to_str())
    for added in spec["added_tokens"]:
        added["special"] = dict(SPECIAL_TAGS)[added["content"]]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(json.dumps(spec)), bos_token="<|endoftext|>",
        eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    return Tokenizer(hf)


class Case:
    def __init__(self, tok: Tokenizer, vocab_size: int):
        self.tok = tok
        self.compiler = GrammarCompiler(tok, vocab_size, max_threads=2)
        self.V = vocab_size
        self.stops = sorted(tok.eos_token_ids)
        # tokens that end JSON values: preferred once a walk is over budget
        self.closers = np.array([bool(b) and set(b) <= set(b'"}]')
                                 for b in self.compiler.info.decoded_vocab], dtype=bool)


@pytest.fixture(scope="module", params=["smollm2", "special_tags", "tiny_target"])
def case(request) -> Case:
    if request.param == "smollm2":
        tok = Tokenizer.from_pretrained(request.getfixturevalue("smollm2"))
        return Case(tok, len(tok.hf))
    if request.param == "special_tags":
        tok = special_tag_tokenizer()
        return Case(tok, len(tok.hf) + 37)       # padded embedding rows, as models have
    if not (TINY_TARGET / "tokenizer.json").is_file():
        pytest.skip("models/tiny-target not trained yet")
    tok = Tokenizer.from_pretrained(TINY_TARGET)
    config = json.loads((TINY_TARGET / "config.json").read_text())
    return Case(tok, int(config.get("vocab_size") or len(tok.hf)))


# random walk: sample uniformly among allowed tokens

def walk(case: Case, state: ConstraintState, rng: random.Random, *, budget: int = 40,
         max_steps: int = 600, forced: dict[int, list[int]] | None = None) -> list[int]:
    """Tokens until the state terminates; forced[step] = tokens accepted as-is at that step.
    Past `budget` steps a stop token, else a closing token, is preferred so JSON finishes."""
    out: list[int] = []
    for step in range(max_steps):
        if state.is_terminated:
            return out
        for token in (forced or {}).get(step, []):
            assert state.accept(token), f"forced token {token} rejected"
            out.append(token)
        allowed = state.mask().numpy()
        assert allowed.shape == (case.V,) and allowed.any()
        choices = np.flatnonzero(allowed)
        if step >= budget:
            stops = [t for t in case.stops if allowed[t]]
            closing = np.flatnonzero(allowed & case.closers)
            choices = stops or (closing if len(closing) else choices)
        token = int(choices[rng.randrange(len(choices))])
        assert state.accept(token)
        out.append(token)
    raise AssertionError(f"walk did not terminate in {max_steps} steps: {case.tok.decode(out)!r}")


def text_of(case: Case, tokens: list[int]) -> str:
    assert tokens[-1] in case.stops, "a finished walk ends with a stop token"
    assert not any(t in case.stops for t in tokens[:-1])
    return case.tok.decode(tokens[:-1])


def check_calls(text: str, *, names: set[str], at_least: int, at_most: int | None, content_ok: bool):
    content, calls = parse_tool_calls(text, request_id="r")
    assert at_least <= len(calls) and (at_most is None or len(calls) <= at_most), text
    if not content_ok:
        assert content is None, text
    for call in calls:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[name])
    return calls


# every kind, random-walked

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(case, name):
    compiled = case.compiler.compile(Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(SCHEMAS[name])))
    for seed in range(3):
        text = text_of(case, walk(case, compiled.new_state(), random.Random(seed)))
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_walks_parse_to_objects(case):
    compiled = case.compiler.compile(Constraint(kind=K.JSON_OBJECT))
    for seed in range(4):
        assert isinstance(json.loads(text_of(case, walk(case, compiled.new_state(), random.Random(seed)))), dict)


@pytest.mark.parametrize("parallel", [True, False])
def test_tools_required_walks_are_only_valid_calls(case, parallel):
    c = Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON, parallel_tool_calls=parallel)
    compiled = case.compiler.compile(c)
    counts = set()
    for seed in range(6):
        # a small budget now and then lets a walk take the "\n" to a second call
        text = text_of(case, walk(case, compiled.new_state(), random.Random(seed), budget=25 + 40 * (seed % 2)))
        calls = check_calls(text, names=set(TOOL_SCHEMAS), at_least=1,
                            at_most=None if parallel else 1, content_ok=False)
        counts.add(len(calls))
    if not parallel:
        assert counts == {1}


def test_tools_required_allows_several_calls_separated_by_newlines(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON))
    two = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    state.replay(case.tok.encode(two))
    assert state.is_completed
    single = case.compiler.new_state(Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON,
                                                parallel_tool_calls=False))
    with pytest.raises(ReplayError):
        single.replay(case.tok.encode(two))


@pytest.mark.parametrize("tool", ["get_weather", "place_order", "ping"])
def test_tool_named_walks_call_exactly_that_tool(case, tool):
    compiled = case.compiler.compile(Constraint(kind=K.TOOL_NAMED, tools=TOOLS_JSON, tool_name=tool))
    for seed in range(3):
        text = text_of(case, walk(case, compiled.new_state(), random.Random(seed)))
        calls = check_calls(text, names={tool}, at_least=1, at_most=1, content_ok=False)
        assert calls[0]["function"]["name"] == tool


def test_tool_without_parameters_still_takes_an_object(case):
    tools = json.dumps([fn("anything", {}), fn("nothing")])
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_REQUIRED, tools=tools))
    with pytest.raises(ReplayError):
        state.replay(case.tok.encode('<tool_call>\n{"name": "anything", "arguments": 3'))
    with pytest.raises(ReplayError):
        state.replay(case.tok.encode('<tool_call>\n{"name": "nothing", "arguments": {"a'))
    state.replay(case.tok.encode('<tool_call>\n{"name": "anything", "arguments": {"a": [1]}}\n</tool_call>'))
    assert state.is_completed


def test_tools_auto_walks_text_or_valid_calls(case):
    compiled = case.compiler.compile(Constraint(kind=K.TOOLS_AUTO, tools=TOOLS_JSON))
    tag = case.tok.encode("<tool_call>")
    saw_call = False
    for seed in range(6):
        # start a call now and then (free text rarely spells the tag by chance)
        forced = {seed % 3 * 4: tag} if seed % 2 == 0 else None
        text = text_of(case, walk(case, compiled.new_state(), random.Random(seed), budget=30, forced=forced))
        calls = check_calls(text, names=set(TOOL_SCHEMAS), at_least=1 if forced else 0,
                            at_most=None, content_ok=True)
        saw_call |= bool(calls)
    assert saw_call


def test_tools_auto_free_text_may_end_at_once(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_AUTO, tools=TOOLS_JSON))
    assert state.mask()[case.stops].all()
    state.replay(case.tok.encode("No tools needed, the answer is 4."))
    assert state.mask()[case.stops].all()


def test_tools_auto_single_call_must_end_after_it(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_AUTO, tools=TOOLS_JSON, parallel_tool_calls=False))
    state.replay(case.tok.encode('Checking. <tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'))
    allowed = set(np.flatnonzero(state.mask().numpy()).tolist())
    assert allowed == set(case.stops)


# special tokens and vocabulary width

def test_tool_tag_token_is_allowed_where_the_tag_starts(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON))
    vocab = case.tok.hf.get_vocab()
    mask = state.mask()
    if "<tool_call>" in vocab:                      # the tag is one token: it must be allowed
        assert mask[vocab["<tool_call>"]]
        assert state.accept(vocab["<tool_call>"])
        assert state.accept(case.tok.encode("\n")[0])
    else:
        assert mask[case.tok.encode("<")[0]]


def test_control_tokens_are_never_allowed_inside_json(case):
    state = case.compiler.new_state(Constraint(kind=K.JSON_OBJECT))
    state.replay(case.tok.encode('{"note": "x'))
    mask = state.mask()
    assert mask.sum() > 100                         # inside a string: nearly anything goes
    for idx, added in case.tok.hf.added_tokens_decoder.items():
        if added.special:
            assert not mask[idx], added.content


def test_strings_never_take_raw_control_characters(case):
    # xgrammar's length-bounded strings let them through unpatched (build.py)
    plain = {"type": "object", "properties": {"city": {"type": "string"}}}
    for schema in (WEATHER, plain):
        state = case.compiler.new_state(Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(schema)))
        state.replay(case.tok.encode('{"city": "a'))
        for ch in "\x00\x0c\t\x1f":
            with pytest.raises(ReplayError):
                state.fork().replay(case.tok.encode(ch + '"}'))
        if schema is plain:          # escapes are fine (xgrammar's bounded strings have none)
            state.replay(case.tok.encode('\\t"}'))


def test_padded_rows_are_never_allowed_and_mask_width_follows_the_model(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOLS_AUTO, tools=TOOLS_JSON))
    mask = state.mask()
    assert mask.shape == (case.V,) and mask.dtype == torch.bool
    assert not mask[len(case.tok.hf):].any()
    assert state.mask(case.V + 5).shape == (case.V + 5,) and not state.mask(case.V + 5)[case.V:].any()


def test_terminated_state_allows_only_stop_tokens(case):
    state = case.compiler.new_state(Constraint(kind=K.JSON_OBJECT))
    state.replay(case.tok.encode("{}"))
    assert state.is_completed and not state.is_terminated
    assert set(np.flatnonzero(state.mask().numpy()).tolist()) == set(case.stops)
    assert state.accept(case.stops[0]) and state.is_terminated
    assert set(np.flatnonzero(state.mask().numpy()).tolist()) == set(case.stops)
    assert not state.accept(case.tok.encode("x")[0])
    bitmask = torch.zeros(2, (case.V + 31) // 32, dtype=torch.int32)
    state.fill_bitmask(bitmask, 1)
    assert torch.equal(unpack_bitmask(bitmask[1], case.V), state.mask())


# replay, rollback, speculative masks

def recorded_walk(case: Case, constraint: Constraint, seed: int):
    state = case.compiler.new_state(constraint)
    tokens = walk(case, state.fork(), random.Random(seed), budget=25)
    masks = []
    for t in tokens:
        masks.append(state.mask())
        assert state.accept(t)
    return state, tokens, masks


KINDS = [Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(ORDER)),
         Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON),
         Constraint(kind=K.TOOLS_AUTO, tools=TOOLS_JSON)]


@pytest.mark.parametrize("constraint", KINDS, ids=lambda c: c.kind.value)
def test_replay_equals_the_original_state(case, constraint):
    _, tokens, masks = recorded_walk(case, constraint, seed=7)
    for n in sorted({0, 1, 2, len(tokens) // 2, len(tokens) - 1}):
        fresh = case.compiler.new_state(constraint)        # decode: a new matcher, same grammar
        fresh.replay(tokens[:n])
        assert fresh.num_accepted == n
        assert torch.equal(fresh.mask(), masks[n])


@pytest.mark.parametrize("constraint", KINDS, ids=lambda c: c.kind.value)
def test_rollback_restores_masks(case, constraint):
    state, tokens, masks = recorded_walk(case, constraint, seed=3)
    state.rollback(1)                                      # un-terminate
    for n in (1, 3, 5):
        if n >= len(tokens):
            break
        state.rollback(n)
        assert torch.equal(state.mask(), masks[len(tokens) - 1 - n])
        assert state.accept_many(tokens[len(tokens) - 1 - n:-1]) == n
    with pytest.raises(ValueError):
        state.rollback(len(tokens) + 1)


@pytest.mark.parametrize("constraint", KINDS, ids=lambda c: c.kind.value)
def test_masks_for_drafts_match_step_by_step_masks_and_leave_state(case, constraint):
    _, tokens, masks = recorded_walk(case, constraint, seed=11)
    state = case.compiler.new_state(constraint)
    state.replay(tokens[:2])
    drafts = tokens[2:7]
    rows = state.masks_for(drafts)
    assert rows.shape == (len(drafts) + 1, case.V)
    for i in range(len(drafts) + 1):
        assert torch.equal(rows[i], masks[2 + i])
    assert state.num_accepted == 2 and torch.equal(state.mask(), masks[2])
    # a draft the grammar rejects: later rows repeat the row where verification stops
    bad = next(t for t in range(case.V) if not masks[3][t])
    rows = state.masks_for([tokens[2], bad, tokens[4]])
    assert torch.equal(rows[1], masks[3]) and torch.equal(rows[2], masks[3]) and torch.equal(rows[3], masks[3])
    assert torch.equal(state.mask(), masks[2])


def test_replay_of_foreign_tokens_fails_and_leaves_state(case):
    state = case.compiler.new_state(Constraint(kind=K.TOOL_NAMED, tools=TOOLS_JSON, tool_name="ping"))
    before = state.mask()
    with pytest.raises(ReplayError) as err:
        state.replay(case.tok.encode('<tool_call>\n{"name": "get_weather"'))
    assert err.value.index > 0 and state.num_accepted == 0
    assert torch.equal(state.mask(), before)


def test_fill_bitmask_packs_the_same_mask(case):
    state = case.compiler.new_state(Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(PERSON)))
    state.replay(case.tok.encode('{"user": {"name": "'))
    bitmask = torch.zeros(3, (case.V + 31) // 32, dtype=torch.int32)
    state.fill_bitmask(bitmask, 2)
    assert torch.equal(unpack_bitmask(bitmask[2], case.V), state.mask())   # bits past V: don't care
    assert torch.equal(unpack_bitmask(pack_mask(state.mask()), case.V), state.mask())


# cache and refusals

def test_cache_counts_hits_and_evicts_least_recent(case):
    compiler = GrammarCompiler(case.tok, case.V, cache_size=2, max_threads=1)
    a = Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON)
    a_again = Constraint(kind=K.TOOLS_REQUIRED, tools=json.dumps(TOOLS))    # equal, not identical
    b = Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON, parallel_tool_calls=False)
    c = Constraint(kind=K.JSON_OBJECT)
    assert compiler.compile(Constraint()) is None and compiler.new_state(Constraint()) is None
    first = compiler.compile(a)
    assert compiler.compile(a_again) is first
    compiler.compile(b)
    stats = compiler.stats()
    assert (stats.hits, stats.misses, stats.size) == (1, 2, 2) and stats.compile_seconds > 0
    compiler.compile(a)          # a is now the most recent
    compiler.compile(c)          # evicts b
    compiler.compile(b)
    stats = compiler.stats()
    assert (stats.hits, stats.misses, stats.size) == (2, 4, 2)
    assert stats.hit_rate == pytest.approx(2 / 6)


BAD = [
    (Constraint(kind=K.JSON_SCHEMA), "without a schema"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema="{not json"), "not valid JSON"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"type": "banana"}'), "banana"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"$ref": "#/$defs/missing"}'), "missing"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"type": "string", "pattern": "(("}'), "parenthesis"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"type": "object", "properties": {"a": {"not": {}}}}'), "'not'"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (Constraint(kind=K.JSON_SCHEMA, json_schema='{"allOf": [{"type": "object"}, {"required": ["a"]}]}'), "allOf"),
    (Constraint(kind=K.TOOLS_REQUIRED), "non-empty list of tools"),
    (Constraint(kind=K.TOOLS_REQUIRED, tools="[]"), "non-empty list of tools"),
    (Constraint(kind=K.TOOLS_AUTO, tools='{"name": "f"}'), "non-empty list of tools"),
    (Constraint(kind=K.TOOL_NAMED, tools=TOOLS_JSON, tool_name="nope"), "'nope'"),
    (Constraint(kind=K.TOOLS_REQUIRED, tools=json.dumps([fn("f"), fn("f")])), "more than once"),
    (Constraint(kind=K.TOOLS_REQUIRED, tools=json.dumps([{"type": "function", "function": {}}])), "no function name"),
    (Constraint(kind=K.TOOLS_REQUIRED, tools=json.dumps([fn("f", {"type": "string"})])), "describe an object"),
    (Constraint(kind=K.TOOLS_AUTO, tools=json.dumps([fn("f", {"type": "object", "properties": {
        "x": {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 4}}}})])), "'if'"),
]


@pytest.mark.parametrize("constraint,words", BAD, ids=[w for _, w in BAD])
def test_bad_constraints_raise_constraint_error(constraint, words):
    with pytest.raises(ConstraintError, match=words) as err:
        build_grammar(constraint)
    assert isinstance(err.value, ValueError)
    assert "/project/cpp" not in str(err.value)


def test_compiler_raises_constraint_error_too(case):
    with pytest.raises(ConstraintError):
        case.compiler.compile(BAD[2][0])
