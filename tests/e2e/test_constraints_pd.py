"""Constraints survive the prefill/decode boundary: for required, named, auto and
json_schema, PD and colocated produce the same tokens (greedy and seeded), and every
forced output parses and validates against its schema. Submitted straight to decode over
NATS (the gateway's part is tested in test_tools_http.py)."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import uuid

import jsonschema
import msgspec
import nats

from pdmesh.bench.workloads import CANON, SCHEMA, TOOLS
from shared import subjects
from shared.contracts.common import encode
from shared.contracts.constraint import Constraint, ConstraintKind
from shared.contracts.messages import DecodeSubmit, Path, TokenChunk
from shared.contracts.sampling import SamplingParams
from shared.toolcalls import parse_tool_calls


def constraints(rng: random.Random):
    """(constraint, tools used) — varied tool subsets for every kind."""
    for kind in itertools.cycle([ConstraintKind.TOOLS_REQUIRED, ConstraintKind.TOOL_NAMED,
                                 ConstraintKind.TOOLS_AUTO, ConstraintKind.JSON_SCHEMA]):
        tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        if kind is ConstraintKind.JSON_SCHEMA:
            yield Constraint(kind=kind, json_schema=json.dumps(SCHEMA, **CANON)), []
        elif kind is ConstraintKind.TOOL_NAMED:
            name = rng.choice(tools)["function"]["name"]
            yield Constraint(kind=kind, tools=json.dumps(tools, **CANON), tool_name=name), tools
        else:
            yield Constraint(kind=kind, tools=json.dumps(tools, **CANON),
                             parallel_tool_calls=rng.random() < 0.5), tools


def check_output(text: str, c: Constraint, tools: list, finish: str) -> None:
    if c.kind is ConstraintKind.JSON_SCHEMA:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
        return
    content, calls = parse_tool_calls(text)
    if c.kind is ConstraintKind.TOOLS_AUTO or finish != "stop":
        return  # free text allowed / cut by max_tokens
    assert calls and not (content or "").strip(), text
    if not c.parallel_tool_calls:
        assert len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        name = call["function"]["name"]
        if c.kind is ConstraintKind.TOOL_NAMED:
            assert name == c.tool_name
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


async def submit_and_collect(nc, decode_iid, prompt_ids, params, constraint, path, fp):
    inbox = f"pdmesh.gateway.tokens.test_{uuid.uuid4().hex[:8]}"
    rid = uuid.uuid4().hex
    q: asyncio.Queue = asyncio.Queue()

    async def cb(msg):
        q.put_nowait(msgspec.json.decode(msg.data, type=TokenChunk))

    sub = await nc.subscribe(inbox, cb=cb)
    msg = DecodeSubmit(request_id=rid, prompt_ids=prompt_ids, params=params,
                       constraint=constraint, tokenizer_fingerprint=fp, reply_subject=inbox,
                       force_path=path)
    r = await nc.request(subjects.decode_submit(decode_iid), encode(msg), timeout=10)
    assert not (r.headers and "Nats-Service-Error-Code" in r.headers), r.data
    toks, text = [], ""
    while True:
        c = await asyncio.wait_for(q.get(), 60)
        if c.error is not None:
            await sub.unsubscribe()
            return None, c.error.message, "error"
        toks += c.token_ids
        text += c.text
        if c.finished:
            break
    await sub.unsubscribe()
    return toks, text, c.finish_reason


def run_cases(mesh, tiny_tokenizer, n: int, seed: int = 0, at_once: int = 8):
    """n cases, each over PD and colocated; at_once cases in flight (deterministic mode:
    batch composition does not change the tokens, so the cases share batches)."""
    rng = random.Random(seed)
    asks = ["What's the weather in Paris?", "Book me a flight to Rome.", "Wake me at 7.",
            "Find papers about NATS.", "Describe yourself as JSON."]
    cases = []
    for i, (c, tools) in zip(range(n), constraints(rng)):
        msgs = [{"role": "user", "content": rng.choice(asks)}]
        ids = tiny_tokenizer.encode_chat(msgs, tools=tools or None)
        params = (SamplingParams(temperature=0.0, max_tokens=48) if i % 2 == 0 else
                  SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=48))
        cases.append((c, tools, ids, params))

    async def run():
        nc = await nats.connect(**mesh.client_options("gateway"))    # who submits to decode
        iid = mesh.procs["decode-0"].instance_id
        gate = asyncio.Semaphore(at_once)

        async def one(c, tools, ids, params):
            async with gate:
                pd, co = await asyncio.gather(*(
                    submit_and_collect(nc, iid, ids, params, c, path, tiny_tokenizer.fingerprint)
                    for path in (Path.PD, Path.COLOCATED)))
            return c, tools, {Path.PD: pd, Path.COLOCATED: co}
        out = await asyncio.gather(*(one(*case) for case in cases))
        await nc.close()
        return out

    return asyncio.run(run())


def test_constrained_pd_equals_colocated_and_outputs_validate(mesh, tiny_tokenizer):
    results = run_cases(mesh, tiny_tokenizer, n=52)
    kinds = set()
    differ = [(c.kind.value, got[Path.PD][1], got[Path.COLOCATED][1])
              for c, tools, got in results if got[Path.PD][0] != got[Path.COLOCATED][0]]
    assert not differ, f"{len(differ)}/{len(results)} PD outputs differ from colocated: {differ[:3]}"
    for c, tools, got in results:
        check_output(got[Path.PD][1], c, tools, got[Path.PD][2])
        kinds.add(c.kind)
    assert len(kinds) == 4
    forced = [r for r in results if r[0].kind in (ConstraintKind.TOOLS_REQUIRED,
                                                  ConstraintKind.TOOL_NAMED)]
    assert sum(r[2][Path.PD][2] == "stop" for r in forced) >= len(forced) // 2
