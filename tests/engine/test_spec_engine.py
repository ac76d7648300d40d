"""Speculative decoding in the engine (shared/engine/spec/runner.py): greedy output equals
plain decoding token for token (deterministic mode) whether requests run together or
alone, through prefix-cache hits, remote prefills, stop strings, max_tokens, logprobs,
grammars and preemption; sampled output follows the plain engine's distribution, repeats
for the same seed and does not depend on the batch; the acceptance counters add up."""
from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import pytest

from shared.contracts.constraint import Constraint, ConstraintKind as K
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.spec import runner as runner_mod
from shared.toolcalls import parse_tool_calls
from tests.conftest import CODE_PROMPTS
from tests.engine.test_constraints import TOOLS, TOOLS_JSON, WEATHER

DET = dict(num_blocks=512, block_size=16, deterministic=True, threads=1, max_num_seqs=16,
           max_num_batched_tokens=128, chunk_size=32)
CHAT = ["Please look up the weather with city Paris and units metric.",
        "Hello! How are you today?", "What is the capital of Kenya?",
        "Sort the numbers 13, 2, 11 and 5.", "Write a haiku about the sea.",
        "Save the person named Ann, age 31."]
CHI2_CRIT_001_DF6 = 22.458     # chi-square at p = 0.001, 6 degrees of freedom


def engine(model, device: str, draft=None, k=4, **kw) -> LLMEngine:
    cfg = DET | {"device": device} | kw
    if draft is not None:
        cfg |= dict(draft_model=str(draft), num_speculative_tokens=k)
    return LLMEngine(EngineConfig(model=str(model), **cfg))


def run(eng: LLMEngine, prompts, params, stagger: bool = False, constraints=None) -> list[dict]:
    """Run requests to the end; stagger: one joins per step while the others decode."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    constraints = constraints or [None] * len(prompts)
    res = [{"token_ids": [], "text": "", "outs": []} for _ in prompts]
    pending = list(range(len(prompts)))
    while pending or eng.has_unfinished:
        while pending:
            i = pending.pop(0)
            eng.add_request(f"q{i}", prompts[i], params[i], constraint=constraints[i])
            if stagger:
                break
        for o in eng.step():
            r = res[int(o.request_id[1:])]
            r["token_ids"] += o.new_token_ids
            r["text"] += o.text
            r["outs"].append(o)
    for r in res:
        r["last"] = r["outs"][-1]
        r["finish"] = (r["last"].finish_reason, r["last"].stop_reason)
    return res


def tokens(res) -> list[list[int]]:
    return [r["token_ids"] for r in res]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    """Code, chat and random-id prompts; the longest takes two catch-up chunks."""
    rng = random.Random(0)
    code = [tiny_tokenizer.encode(p) for p in CODE_PROMPTS[:12]]
    chat = [tiny_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHAT]
    rand = [[rng.randrange(10, 8000) for _ in range(n)] for n in (5, 23, 61, 150)]
    return code + chat + rand


def greedy(i: int, **kw) -> SamplingParams:
    """Varied max_tokens; every third request runs past EOS; some hold EOS back
    (min_tokens) or repeat less (penalties move as drafts are accepted)."""
    extra = [{}, {"min_tokens": 12}, {}, {"repetition_penalty": 1.3, "frequency_penalty": 0.4}]
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 17 + i % 7,
                             "ignore_eos": i % 3 == 0} | extra[i % 4] | kw)


@pytest.fixture(scope="module")
def plain(tiny_target, prompts, device) -> list[dict]:
    return run(engine(tiny_target, device), prompts, [greedy(i) for i in range(len(prompts))])


# greedy: token for token

@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("together", [True, False], ids=["batch", "alone"])
def test_greedy_equals_plain_decoding(tiny_target, tiny_draft, prompts, plain, k, together,
                                      device):
    eng = engine(tiny_target, device, tiny_draft, k=k)
    params = [greedy(i) for i in range(len(prompts))]
    if together:
        got = run(eng, prompts, params, stagger=True)
    else:
        got = [run(eng, [p], [params[i]])[0] for i, p in enumerate(prompts)]
    assert tokens(got) == tokens(plain)
    assert [r["text"] for r in got] == [r["text"] for r in plain]
    assert [r["finish"] for r in got] == [r["finish"] for r in plain]
    assert eng.stats()["spec_steps"] > 0 and eng.pool.num_used == 0
    if k > 1:   # one output carries a step's tokens
        assert any(len(o.new_token_ids) > 1 for r in got for o in r["outs"])


def test_drafts_are_the_draft_models_own_greedy_continuation(tiny_target, tiny_draft, prompts,
                                                             monkeypatch, device):
    """The draft's KV bookkeeping (catch-up, accepted/rejected drafts, shared prompt
    blocks) is right: every step's drafts equal what the draft model, run on its own over
    the same context, generates greedily."""
    seen = []
    propose = runner_mod.SpecRunner.propose

    def recording(self, batch):
        propose(self, batch)
        seen.extend((s.seq.prompt_ids + s.seq.output_ids, s.drafts) for s in batch if s.drafts)
    monkeypatch.setattr(runner_mod.SpecRunner, "propose", recording)
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    again = prompts[-2:]                                                # L1 hits
    run(engine(tiny_target, device, tiny_draft), prompts + again, p, stagger=True)
    alone = engine(tiny_draft, device, quantize=EngineConfig(model="x").draft_quant)   # as drafting
    want = [alone.generate([ctx], SamplingParams(temperature=0.0, max_tokens=len(d),
                                                 ignore_eos=True))[0]["token_ids"]
            for ctx, d in seen]
    assert len(seen) > 100 and [d for _, d in seen] == want


def test_prefix_cache_hits_change_nothing(tiny_target, tiny_draft, device):
    rng = random.Random(1)
    shared = [rng.randrange(10, 8000) for _ in range(70)]      # two whole 32-token chunks
    ps = [shared + [rng.randrange(10, 8000) for _ in range(rng.randrange(3, 20))]
          for _ in range(6)]
    p = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    want = tokens(run(engine(tiny_target, device, prefix_cache=False), ps, p))
    eng = engine(tiny_target, device, tiny_draft)
    first = run(eng, ps[:1], p)          # its prompt blocks enter the cache
    rest = run(eng, ps[1:], p)           # these share them (target KV only) while drafting
    assert tokens(first + rest) == want
    assert eng.stats()["prefix_hit_tokens"] == 5 * 64


def test_stop_strings_cut_inside_a_step_and_max_tokens_holds(tiny_target, tiny_draft, prompts,
                                                             plain, monkeypatch, device):
    """Stop strings and stop token ids taken from the middle of the plain outputs;
    max_tokens 1..6 elsewhere."""
    params = []
    for i, r in enumerate(plain):
        if i % 5 == 4:
            params.append(greedy(i, max_tokens=40, stop_token_ids=(r["token_ids"][6],)))
        elif len(r["text"]) > 12:
            params.append(greedy(i, max_tokens=40, stop=(r["text"][8:11],)))
        else:
            params.append(greedy(i, max_tokens=1 + i % 6, ignore_eos=True))
    want = run(engine(tiny_target, device), prompts, params)
    assert sum(isinstance(r["finish"][1], str) for r in want) >= 8    # stopped by a string
    assert sum(isinstance(r["finish"][1], int) for r in want) >= 3    # by a stop token
    # record steps whose verified tokens were not all appended: the request ended inside
    emitted, cut = [], []
    verify, method = runner_mod.verify, runner_mod.SpecRunner.verify

    def recording_verify(*a, **kw):
        res = verify(*a, **kw)
        emitted.append(len(res.outputs))
        return res

    def recording_method(self, s, logits):
        out = method(self, s, logits)
        if len(out.new_token_ids) < emitted[-1]:
            cut.append(out.finish_reason)
        return out
    monkeypatch.setattr(runner_mod, "verify", recording_verify)
    monkeypatch.setattr(runner_mod.SpecRunner, "verify", recording_method)
    got = run(engine(tiny_target, device, tiny_draft), prompts, params, stagger=True)
    assert [(r["token_ids"], r["text"], r["finish"]) for r in got] == \
        [(r["token_ids"], r["text"], r["finish"]) for r in want]
    assert "stop" in cut
    assert all(len(r["token_ids"]) <= p.max_tokens for r, p in zip(got, params))


def test_remote_prefill_then_speculative_decode(tiny_target, tiny_draft, prompts, plain, device):
    """Prompt KV written into reserved blocks (as a prefill worker would), then decode:
    the draft prefills the prompt itself; output equals colocated plain decoding."""
    idx = [0, 5, 12, 15, 19, 21]          # code, chat and random (the 150-token one too)
    worker = engine(tiny_target, device)          # plays the prefill worker
    eng = engine(tiny_target, device, tiny_draft)
    first = {}
    for i in idx:
        rid = f"q{i}"
        worker.add_request(rid, prompts[i], greedy(i), prefill_only=True)
        while worker.has_unfinished:
            for o in worker.step():
                first[rid] = o.new_token_ids[0]
        seq, _ = eng.port.hold(rid, prompts[i], greedy(i))
        skip = seq.num_cached // eng.cfg.block_size    # leading blocks cached here
        dest = seq.block_table[skip:]
        eng.kv[:, :, dest] = worker.kv[:, :, worker.port.kept_blocks(rid)[skip:skip + len(dest)]]
        worker.release(rid)
    res = {rid: eng.port.resume(rid, tok).new_token_ids for rid, tok in first.items()}
    while eng.has_unfinished:
        for o in eng.step():
            res[o.request_id] += o.new_token_ids
    assert [res[f"q{i}"] for i in idx] == [plain[i]["token_ids"] for i in idx]
    assert eng.stats()["spec_steps"] > 0 and eng.pool.num_used == 0


def test_logprobs_are_those_of_plain_decoding(tiny_target, tiny_draft, prompts, device):
    """One per emitted token, bit for bit the plain engine's: each verification row is
    computed exactly as a decode step computes it (one chunk-shaped attention call over
    the k+1 rows would already change the floats)."""
    ps = prompts[:6] + prompts[12:16]
    params = [greedy(i, logprobs=3) for i in range(len(ps))]
    want = run(engine(tiny_target, device), ps, params)
    got = run(engine(tiny_target, device, tiny_draft), ps, params)
    for w, g in zip(want, got):
        lps = [lp for o in g["outs"] for lp in o.logprobs]
        assert len(lps) == len(g["token_ids"])
        assert lps == [lp for o in w["outs"] for lp in o.logprobs]


@pytest.mark.parametrize("kind", ["json_schema", "tools_required"])
def test_constrained_output_is_valid_and_equals_plain(tiny_target, tiny_draft, tiny_tokenizer,
                                                      kind, device):
    if kind == "json_schema":
        c, tools = Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(WEATHER)), None
    else:
        c, tools = Constraint(kind=K.TOOLS_REQUIRED, tools=TOOLS_JSON), TOOLS
    ps = [tiny_tokenizer.encode_chat([{"role": "user", "content": m}], tools=tools)
          for m in CHAT[:4]]
    p = SamplingParams(temperature=0.0, max_tokens=80)
    want = run(engine(tiny_target, device), ps, p, constraints=[c] * len(ps))
    eng = engine(tiny_target, device, tiny_draft)
    got = run(eng, ps, p, constraints=[c] * len(ps))
    assert tokens(got) == tokens(want)
    assert eng.stats()["spec_steps"] > 0
    for r in got:
        assert r["finish"][0] == "stop"         # the grammar completed
        if kind == "json_schema":
            jsonschema.validate(json.loads(r["text"]), WEATHER)
        else:
            _, calls = parse_tool_calls(r["text"])
            assert calls and all(x["function"]["name"] in {t["function"]["name"] for t in TOOLS}
                                 for x in calls)


def test_sampled_constrained_output_is_valid_and_repeats(tiny_target, tiny_draft, tiny_tokenizer,
                                                         device):
    c = Constraint(kind=K.JSON_SCHEMA, json_schema=json.dumps(WEATHER))
    ps = [tiny_tokenizer.encode_chat([{"role": "user", "content": m}]) for m in CHAT]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=120) for i in range(len(ps))]
    eng = engine(tiny_target, device, tiny_draft)
    got = run(eng, ps, params, constraints=[c] * len(ps))
    for r in got:
        assert r["finish"][0] == "stop"
        jsonschema.validate(json.loads(r["text"]), WEATHER)
    assert tokens(run(eng, ps[::-1], params[::-1], constraints=[c] * len(ps)))[::-1] == tokens(got)
    assert eng.stats()["spec_accepted"] > 0


def test_a_failed_load_in_the_batch_voids_the_speculative_step(tiny_target, tiny_draft, prompts,
                                                                plain, device):
    """A step whose forward fails (a lower-tier load broke) counts for no one: the
    speculating neighbour drafts again and still gives the plain tokens."""
    i = 12
    eng = engine(tiny_target, device, tiny_draft)
    eng.add_request("q", prompts[i], greedy(i))
    got = [t for _ in range(3) for o in eng.step() for t in o.new_token_ids]
    load = eng.add_request("b", list(range(100, 180)), greedy(0, max_tokens=2), tier_blocks=4)
    load.fail("checksum mismatch")
    assert eng.step() == [] and eng.counters["load_failures"] == 1
    while eng.has_unfinished:
        got += [t for o in eng.step() if o.request_id == "q" for t in o.new_token_ids]
    assert got == plain[i]["token_ids"]


def test_preemption_recomputes_draft_and_target(tiny_target, tiny_draft, prompts, device):
    """A pool too small for everyone (non-deterministic mode preempts): every request
    completes with the plain engine's tokens and every block comes back."""
    small = dict(deterministic=False, num_blocks=14, block_size=8, max_num_batched_tokens=256,
                 chunk_size=256)
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ps = prompts[:10]
    want = tokens(run(engine(tiny_target, device, deterministic=False), ps, p))
    eng = engine(tiny_target, device, tiny_draft, **small)
    preempt, n = eng.scheduler.preempt, [0]

    def counting(seq):
        n[0] += 1
        preempt(seq)
    eng.scheduler.preempt = counting
    assert tokens(run(eng, ps, p)) == want
    assert n[0] > 0 and eng.stats()["spec_steps"] > 0
    assert eng.pool.num_used == 0


# sampled

def third_tokens(eng: LLMEngine, prompt, seeds) -> Counter:
    ps = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=s) for s in seeds]
    return Counter(r["token_ids"][3] for r in run(eng, [prompt] * len(seeds), ps))


def homogeneity(a: Counter, b: Counter, top: int) -> tuple[float, list[list[int]]]:
    """Pearson chi-square of a 2 x (top + 1) table: the most common tokens, then the rest."""
    keys = [t for t, _ in (a + b).most_common(top)]
    rows = [[c[t] for t in keys] + [c.total() - sum(c[t] for t in keys)] for c in (a, b)]
    n, cols = a.total() + b.total(), [x + y for x, y in zip(*rows)]
    expected = [[sum(r) * c / n for c in cols] for r in rows]
    stat = sum((o - e) ** 2 / e for r, er in zip(rows, expected) for o, e in zip(r, er))
    return stat, rows


def test_sampled_tokens_follow_the_plain_distribution(tiny_target, tiny_draft, tiny_tokenizer,
                                                       device):
    """Token 3 of 400 seeded samples (drafted at k=4 after the first token) against 400
    plain samples with other seeds: chi-square homogeneity over the top 6 tokens + rest."""
    prompt = tiny_tokenizer.encode_chat([{"role": "user", "content": CHAT[3]}])
    fast = dict(deterministic=False, max_num_seqs=64, max_num_batched_tokens=512, chunk_size=256)
    plain_counts = third_tokens(engine(tiny_target, device, **fast), prompt, range(10_000, 10_400))
    eng = engine(tiny_target, device, tiny_draft, **fast)
    spec_counts = third_tokens(eng, prompt, range(400))
    st = eng.stats()
    assert 0 < st["spec_accepted"] < st["spec_proposed"]      # both accepts and rejections
    stat, rows = homogeneity(plain_counts, spec_counts, 6)
    assert min(map(min, rows)) >= 5, rows                     # every cell is populated
    assert stat < CHI2_CRIT_001_DF6, (stat, rows)


def test_sampled_tokens_repeat_for_the_seed_whatever_the_batch(tiny_target, tiny_draft, prompts,
                                                               device):
    """Deterministic mode: a seeded request samples the same tokens alone, in a batch
    with others joining, and again."""
    ps = prompts[12:18] + prompts[:4]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=24,
                             ignore_eos=True) for i in range(len(ps))]
    eng = engine(tiny_target, device, tiny_draft)
    alone = [run(eng, [p], [params[i]])[0]["token_ids"] for i, p in enumerate(ps)]
    assert tokens(run(eng, ps, params, stagger=True)) == alone
    assert tokens(run(engine(tiny_target, device, tiny_draft), ps, params)) == alone


# counters and configuration

def test_acceptance_counters_are_sane(tiny_target, tiny_draft, prompts, device):
    k = 4
    eng = engine(tiny_target, device, tiny_draft, k=k)
    got = run(eng, prompts, [greedy(i) for i in range(len(prompts))], stagger=True)
    totals = Counter()
    for r in got:
        steps = [(o.spec_steps, o.spec_proposed, o.spec_accepted) for o in r["outs"]]
        assert steps == sorted(steps)                            # cumulative
        s, prop, acc = steps[-1]
        totals.update(spec_steps=s, spec_proposed=prop, spec_accepted=acc)
        assert s > 0 and 0 <= acc <= prop <= k * s
        assert 1.0 <= (acc + s) / s <= k + 1
    st = eng.stats()
    assert {n: st[n] for n in totals} == dict(totals)
    assert 1.5 < (st["spec_accepted"] + st["spec_steps"]) / st["spec_steps"] < k + 1


def test_configuration_is_checked(tiny_target, tmp_path, device):
    from tests.engine.random_models import make_random_model

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model=str(tiny_target), draft_model="x", num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model=str(tiny_target), draft_model="x", num_speculative_tokens=8,
                     max_num_batched_tokens=8, max_num_seqs=8, chunk_size=8)
    other = make_random_model(tmp_path / "other", arch="llama")       # vocab 512
    with pytest.raises(ValueError, match="vocab_size 512"):
        engine(tiny_target, device, other)
    off = engine(tiny_target, device, other, k=0)                             # 0 disables it
    assert off.spec is None and off.draft_kv is None
