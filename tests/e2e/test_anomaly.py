"""Invariant 5 through the whole mesh: speculative decoding on both decode instances
(tiny-target + tiny-draft, deterministic mode); decode-0 injects TEST ONLY faults into
requests chosen by seed. A flagged request is aborted on decode-0 (AnomalyEvent on
pdmesh.evt.request.anomaly), re-dispatched by the gateway to decode-1 and answered exactly
as plain greedy decoding answers it; clean requests are never flagged; a constrained
request decoded speculatively gives plain decoding's tool call; a stream that already sent
tokens ends with an anomaly_detected error event that says to retry.

Requests run one at a time on an idle mesh, where the gateway picks decode-0 (equal load
and free blocks: the lower id), so every request's first attempt is on the faulty one.

What the monitor cannot see (scripts/bench_monitor.py measures it): corruption the target
absorbs fluently. One zeroed layer or a swap with other blocks changes the output, yet its
acceptance stays in the clean range; the last test injects them and reports what was
missed as an expected failure (xfail).

PDMESH_FAULT_NO_MONITOR=1 (manual runs only) turns the monitor off, and the first test
then fails: the corrupted requests are answered wrong and never flagged."""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import jsonschema
import msgspec
import nats
import pytest

from pdmesh.local.cluster import Cluster
from services.gateway.config import GatewayConfig
from services.gateway.model import ModelSpec
from services.gateway.validate import parse_chat
from shared import subjects
from shared.contracts.messages import AnomalyEvent, Heartbeat
from shared.contracts.sampling import SamplingParams
from shared.toolcalls import parse_tool_calls

from .conftest import DET, det_overrides, reference_engine
from .helpers import body, micro_stats, sse_events

MOD = 1000                           # fault_select_seed_mod: seeds k * MOD are faulty
KINDS = ("zero_layer", "swap", "noise", "repeat_loop")   # fault kind k % 4
NOISE_SCALE = 30.0                   # garbage KV, an incoherent target: what the monitor sees
# thresholds calibrated for tiny-target + tiny-draft (docs/bench/monitor_tiny-target.json):
# the default 1.4 flags some clean greedy requests on short code prompts (as
# tiny_prompts[13], accept length 1.39 at 129 tokens)
CALIBRATED = {"monitor_accept_length_low": 1.1, "monitor_accept_rate_high": 0.96}
MAX_TOKENS = 200                     # low_accept_length judges past 128 tokens
DECODE0, DECODE1 = "decode_0", "decode_1"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}


def seed(kind: str, n: int = 0) -> int:
    """A seed decode-0 gives `kind` (n: the n-th such seed)."""
    return MOD * (KINDS.index(kind) + len(KINDS) * n)


@pytest.fixture(scope="module")
def mesh(tiny_target, tiny_draft):
    # the acceptance rules under test alone: the repetition rule (on by default) would
    # catch the repeat_loop fault first, at 128 tokens (tests/test_monitor.py covers it)
    spec = {"draft_model": str(tiny_draft), "num_speculative_tokens": 4,
            "monitor_repeat_window": 0} | CALIBRATED
    if os.environ.get("PDMESH_FAULT_NO_MONITOR"):   # manual runs only: the guard off
        spec["monitor"] = False
    faulty = {"mode": "pd", "prefix_cache": False, "fault_corrupt_kv": "zero_layer,swap,noise",
              "fault_repeat_loop": True, "fault_select_seed_mod": MOD,
              "fault_noise_scale": NOISE_SCALE}
    with Cluster(str(tiny_target), prefill=1, decode=2, **DET, echo=False,
                 overrides=det_overrides(**spec) | {"decode-0": faulty}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy decoding (no draft), configured like the mesh's decode."""
    eng = reference_engine(tiny_target)
    return lambda prompt: eng.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]["token_ids"]


class Probe:
    """The test's NATS side: anomaly events, and decode heartbeats to wait for an idle mesh."""

    def __init__(self, url: str):
        self.url = url
        self.events: list[AnomalyEvent] = []
        self.beats: dict[str, tuple[float, Heartbeat]] = {}

    async def __aenter__(self) -> "Probe":
        self.nc = await nats.connect(self.url)
        await self.nc.subscribe(subjects.request_anomaly(), cb=self._event)
        await self.nc.subscribe(subjects.heartbeat("decode"), cb=self._beat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def _event(self, msg) -> None:
        self.events.append(msgspec.json.decode(msg.data, type=AnomalyEvent))

    async def _beat(self, msg) -> None:
        hb = msgspec.json.decode(msg.data, type=Heartbeat)
        self.beats[hb.instance_id] = (time.monotonic(), hb)

    async def idle(self, timeout: float = 30.0) -> None:
        """Until both decode instances report, afresh, nothing running, queued or
        quarantined: the next request goes to decode-0."""
        t0 = time.monotonic()
        while True:
            fresh = [hb for t, hb in self.beats.values() if t > t0]
            if len(fresh) == 2 and all(hb.running == hb.waiting == hb.queue_depth
                                       == hb.blocks_quarantined == 0 for hb in fresh):
                return
            assert time.monotonic() - t0 < timeout, f"mesh not idle: {fresh}"
            await asyncio.sleep(0.05)

    def flagged(self, rid: str) -> list[AnomalyEvent]:
        return [e for e in self.events if e.request_id == rid]


async def complete(http, url: str, prompt, seed_: int) -> tuple[str, list[int], str]:
    """(response id, token ids, decode instance that answered)"""
    async with http.post(url + "/v1/completions", json=body(
            prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
            seed=seed_)) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["id"], data["choices"][0]["token_ids"], r.headers["x-pdmesh-decode"]


async def gateway_metrics(http, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_corrupted_requests_are_flagged_redispatched_and_answered_right(
        mesh, tiny_prompts, reference):
    cases = [("noise", 0), ("noise", 1), ("repeat_loop", 0), ("repeat_loop", 1),
             (None, 7), (None, 1234)]                       # None: clean (no fault)

    async def run():
        async with Probe(mesh.nats_url) as probe, aiohttp.ClientSession() as http:
            out = []
            for prompt, (kind, n) in zip(tiny_prompts, cases):
                await probe.idle()
                s = seed(kind, n) if kind else n
                out.append((prompt, kind, *await complete(http, mesh.url, prompt, s)))
            await asyncio.sleep(0.3)                        # the last events
            return out, probe, await gateway_metrics(http, mesh.url)

    results, probe, text = asyncio.run(run())
    rule = {"noise": "low_accept_length", "repeat_loop": "high_accept_rate"}
    for prompt, kind, rid, tokens, served_by in results:
        events = probe.flagged(rid)
        assert tokens == reference(prompt), (kind, rid)
        if kind is None:
            assert events == [] and served_by == DECODE0
        else:
            assert [(e.instance_id, e.rule) for e in events] == [(DECODE0, rule[kind])], kind
            assert served_by == DECODE1
            assert events[0].generated_tokens > 128 and events[0].accept_length > 0
    assert metric(text, "pdmesh_redispatches_total") == 4
    assert metric(text, 'pdmesh_anomaly_aborts_total{rule="low_accept_length"}') == 2
    assert metric(text, 'pdmesh_anomaly_aborts_total{rule="high_accept_rate"}') == 2
    dec = asyncio.run(micro_stats(mesh.nats_url, "decode"))
    assert dec["fault_noise_injected"] == 2 and dec["fault_repeat_loop_injected"] == 2
    assert dec["anomaly_low_accept_length"] == 2 and dec["anomaly_high_accept_rate"] == 2
    assert dec["spec_steps"] > 0


def test_constrained_tool_call_with_speculation_equals_plain_decoding(mesh, tiny_target):
    req = {"model": "tiny-target", "tool_choice": "required", "tools": [WEATHER],
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
           "temperature": 0, "max_tokens": 160, "seed": 5, "return_token_ids": True}

    async def run():
        async with Probe(mesh.nats_url) as probe, aiohttp.ClientSession() as http:
            await probe.idle()
            async with http.post(mesh.url + "/v1/chat/completions", json=req) as r:
                data = await r.json()
                assert r.status == 200, data
                return data, probe.events

    data, events = asyncio.run(run())
    prep = parse_chat(json.dumps(req).encode(), ModelSpec.load(GatewayConfig(
        model=str(tiny_target))))
    eng = reference_engine(tiny_target)
    eng.add_request("ref", prep.prompt_ids, prep.params, constraint=prep.constraint)
    want: list[int] = []
    while eng.has_unfinished:
        want += [t for o in eng.step() for t in o.new_token_ids]
    choice = data["choices"][0]
    assert choice["token_ids"] == want and events == []
    _, calls = parse_tool_calls(eng.tokenizer.decode(want))
    got = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    jsonschema.validate(json.loads(got[0]["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert data["usage"]["spec_accept_length"] >= 1.0        # it did speculate


def test_stream_that_already_sent_tokens_gets_an_error_event_with_a_retry_hint(
        mesh, tiny_prompts):
    prompt = tiny_prompts[10]

    async def run():
        async with Probe(mesh.nats_url) as probe, aiohttp.ClientSession() as http:
            before = metric(await gateway_metrics(http, mesh.url), "pdmesh_redispatches_total")
            await probe.idle()
            tokens, error = [], None
            async with http.post(mesh.url + "/v1/completions", json=body(
                    prompt, stream=True, temperature=0.0, max_tokens=MAX_TOKENS,
                    ignore_eos=True, seed=seed("noise", 5))) as r:
                assert r.status == 200
                async for chunk in sse_events(r):
                    if "error" in chunk:
                        error = chunk["error"]
                        continue
                    tokens += chunk["choices"][0].get("token_ids") or []
            after = metric(await gateway_metrics(http, mesh.url), "pdmesh_redispatches_total")
            return tokens, error, after - before

    tokens, error, redispatched = asyncio.run(run())
    assert len(tokens) >= 100                # streamed before the monitor could judge
    assert error is not None and error["code"] == "anomaly_detected"
    assert "retry" in error["message"] and error["type"] == "server_error"
    assert redispatched == 0


def test_corruption_the_target_absorbs_is_not_detected_yet(mesh, tiny_prompts, reference):
    """Injected, usually changes the output, and is not flagged: an expected failure (xfail)
    that passes the day the monitor sees it."""
    async def run():
        async with Probe(mesh.nats_url) as probe, aiohttp.ClientSession() as http:
            out = []
            for prompt, kind in zip(tiny_prompts[12:], ("zero_layer", "swap")):
                # tiny_prompts[13] is the clean run that falls below 1.4 (see CALIBRATED)
                await probe.idle()
                rid, tokens, _ = await complete(http, mesh.url, prompt, seed(kind, 2))
                await asyncio.sleep(0.3)
                out.append((kind, tokens != reference(prompt), bool(probe.flagged(rid))))
            return out

    results = asyncio.run(run())
    dec = asyncio.run(micro_stats(mesh.nats_url, "decode"))
    assert dec["fault_zero_layer_injected"] == 1 and dec["fault_swap_injected"] == 1
    missed = [f"{kind} (output {'changed' if changed else 'unchanged'})"
              for kind, changed, flagged in results if not flagged]
    if missed:
        pytest.xfail("not flagged: " + ", ".join(missed))
