"""n > 1 at the gateway (choices.py), against scripted decode instances: choice 0 first,
then the others on choice 0's instance with seeds s + 1, ...; each choice is re-dispatched
on its own (an anomaly in choice 1 moves choice 1 only); a stream's chunks carry their
choice's index; usage counts the prompt once. Real gateway and nats-server."""
from __future__ import annotations

import json

import pytest

from shared.contracts.messages import DecodeSubmit

from . import test_redispatch as scripted
from .test_redispatch import BODY, CHAT, anomaly, good, metrics

mesh = scripted.mesh     # the scripted decode instances' fixture

pytestmark = pytest.mark.timeout(60)


def only_choice_1(bad, ok=good):
    def script(sub: DecodeSubmit):
        return (bad if sub.request_id.split(".")[0].endswith("-1") else ok)(sub)
    return script


async def test_choices_go_to_choice_0s_instance_with_seeds_s_plus_i(mesh):
    http, d0, d1 = mesh
    d1.blocks_free = 5000                            # the emptier one: choice 0 goes there
    await d1.beat()
    r = await http.post(CHAT, json=BODY | {"n": 3})
    body = await r.json()
    assert r.status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "good good good " for c in body["choices"])
    inst = r.headers["x-pdmesh-decode"]
    subs = (d0 if inst == "d_0" else d1).subs
    assert len(subs) == 3 and not (d1 if inst == "d_0" else d0).subs
    assert [s.params.seed for s in subs] == [7, 8, 9]
    assert len({s.request_id for s in subs}) == 3
    assert body["usage"]["completion_tokens"] == 9
    assert body["usage"]["prompt_tokens"] == len(subs[0].prompt_ids)


async def test_an_anomaly_in_one_choice_redispatches_that_choice_only(mesh):
    http, d0, d1 = mesh
    d0.script = only_choice_1(anomaly(after=1))
    r = await http.post(CHAT, json=BODY | {"n": 2})
    body = await r.json()
    assert r.status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == ["good good good "] * 2
    assert [s.params.seed for s in d0.subs] == [7, 8]
    assert [s.params.seed for s in d1.subs] == [8]            # choice 1 again, elsewhere
    assert "pdmesh_redispatches_total 1" in await metrics(http)


async def test_stream_chunks_carry_their_choice_index(mesh):
    http, d0, _d1 = mesh
    r = await http.post(CHAT, json=BODY | {"n": 2, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert r.status == 200
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    text: dict[int, str] = {}
    for e in events[:-1]:
        (ch,) = e["choices"]
        text[ch["index"]] = text.get(ch["index"], "") + (ch["delta"].get("content") or "")
    assert text == {0: "good good good ", 1: "good good good "}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


async def test_a_choice_that_fails_fails_the_request_and_aborts_the_others(mesh):
    http, d0, d1 = mesh
    d0.script = d1.script = only_choice_1(anomaly(after=1))
    r = await http.post(CHAT, json=BODY | {"n": 2})
    err = (await r.json())["error"]
    assert r.status == 503 and err["code"] == "anomaly_detected"
