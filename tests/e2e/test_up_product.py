"""`pdmesh up` as vLLM's users launch it (issue 28): vLLM's everyday flags behave as vLLM's do,
and the supervisor gives up on a crash loop, saying which child and why. A real `pdmesh up`
subprocess, found through its run record; the tiny model, auth on (the default), logs as
JSON lines (--log-format json) with the engines' throughput line every second."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.local.launched import UpMesh
from tests.conftest import TINY_TARGET

KEY = "k-" + "x" * 30


@pytest.fixture(scope="module")
def up():
    loop = asyncio.new_event_loop()
    m = UpMesh("--model", str(TINY_TARGET), "--api-key", KEY,
               "--max-model-len", "512", "--served-model-name", "tiny", "--restart-limit", "2",
               "--log-format", "json", env={"PDMESH_LOG_STATS_S": "1"})
    try:
        loop.run_until_complete(m.start())
        yield m, loop
    finally:
        loop.run_until_complete(m.stop())
        loop.close()


def run(up, coro):
    return up[1].run_until_complete(asyncio.wait_for(coro, 300))


async def _get(url: str, key: str | None = None, body: dict | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        if body is None:
            async with http.get(url, headers=headers) as r:
                return r.status, await r.json()
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, await r.json()


def test_api_key_served_model_name_and_max_model_len_as_vllm(up):
    m, _ = up
    status, body = run(up, _get(m.url + "/v1/models"))
    assert status == 401 and "error" in body
    status, body = run(up, _get(m.url + "/v1/models", KEY))
    assert status == 200
    assert [(c["id"], c["max_model_len"]) for c in body["data"]] == [("tiny", 512)]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "def fib(n):"}]}
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))   # no max_tokens
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 512
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat | {"max_tokens": 600}))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def json_lines(m: UpMesh, child: str) -> list[dict]:
    """The child's log lines (`[child] {...}` in pdmesh up's output), each one JSON object."""
    prefix = f"[{child}] "
    lines = [line[len(prefix):] for line in list(m.lines) if line.startswith(prefix)]
    return [json.loads(line) for line in lines]      # a line that is not JSON fails here


def test_logs_are_json_with_an_access_line_and_a_throughput_line(up):
    m, _ = up
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 8}
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
    assert status == 200, body
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        access = [r for r in json_lines(m, "gateway-0") if r["logger"] == "pdmesh.access"
                  and r.get("request_id") == body["id"]]
        stats = [r for r in json_lines(m, "decode-0") if r["logger"] == "pdmesh.engine.stats"
                 and r["generation_tok_s"] > 0]
        if access and stats:
            break
        time.sleep(0.5)
    assert access, m.tail(40)
    a = access[-1]
    assert a["service"] == "gateway" and a["instance"] and a["level"] == "info"
    assert (a["method"], a["path"], a["status"]) == ("POST", "/v1/chat/completions", 200)
    assert a["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert a["completion_tokens"] == body["usage"]["completion_tokens"]
    assert a["placement"] in ("pd", "colocated") and a["ttft_ms"] <= a["latency_ms"]
    assert KEY not in json.dumps(a)                      # never the key
    assert stats, m.tail(40)
    s = stats[-1]
    assert s["service"] == "decode" and 0 <= s["kv_usage"] <= 1 and "running" in s
    assert all(r["time"].endswith("Z") and r["message"] for r in json_lines(m, "decode-0"))


def test_metrics_carry_vllm_names_for_the_served_model(up):
    m, _ = up
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x = "}], "max_tokens": 4}
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
    assert status == 200, body
    finished = body["choices"][0]["finish_reason"]       # the tiny model may stop early
    text = run(up, scrape(m))
    for series in ('vllm:time_to_first_token_seconds_count{model_name="tiny"}',
                   'vllm:inter_token_latency_seconds_count{model_name="tiny"}',
                   'vllm:e2e_request_latency_seconds_count{model_name="tiny"}',
                   'vllm:generation_tokens_total{model_name="tiny"}',
                   f'vllm:request_success_total{{finished_reason="{finished}",model_name="tiny"}}',
                   'vllm:num_requests_running{model_name="tiny"}',
                   'vllm:kv_cache_usage_perc{model_name="tiny"}'):
        assert series in text, series


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdmesh.json"


def test_the_grafana_dashboard_reads_only_series_the_mesh_exposes(up):
    """Every series a panel of deploy/grafana/pdmesh.json queries is a metric family the
    live gateway's /metrics declares (each service's series federated into it)."""
    text = run(up, scrape_mesh(up[0]))
    families = {f.name for f in text_string_to_metric_families(text)}
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = set(re.findall(r"\b(?:vllm:|pdmesh_)[a-z0-9_:]+", " ".join(exprs)))
    assert len(names) >= 15, names
    missing = [n for n in sorted(names) if n not in families
               and re.sub(r"_total$", "", re.sub(r"_(bucket|count|sum)$", "", n)) not in families]
    assert not missing, missing


SERVICES = ('service="decode"', 'service="prefill"', 'service="kvstore"')


async def scrape_mesh(m: UpMesh, after: str = "", grown: tuple[str, ...] = ()) -> str:
    """/metrics once every service's federated series are in it (and differ from `after`:
    the gateway has refreshed them since), and each counter named in `grown` is above its
    value in `after` (the gateway refreshes each service's series on its own: one that
    changed says nothing of prefill's)."""
    deadline = time.monotonic() + 60
    while True:
        text = await scrape(m)
        if all(s in text for s in SERVICES) and (not after or federated(text) != federated(after)) \
                and all(grew(after, text, name) for name in grown):
            return text
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.5)


def grew(before: str, after: str, name: str) -> bool:
    old, new = samples(before, ("counter",)), samples(after, ("counter",))
    return any(k[0] == name and v > old.get(k, 0.0) for k, v in new.items())


def federated(text: str) -> list[str]:
    return [line for line in text.splitlines() if "service=" in line]


def samples(text: str, kinds: tuple[str, ...]) -> dict[tuple, float]:
    """(sample name, labels) -> value, of the families of these kinds."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) if f.type in kinds
            for s in f.samples}


def test_every_service_is_federated_with_its_pd_series_and_counters_only_go_up(up):
    """One scrape of the gateway shows decode's, prefill's and kvstore's own series,
    labelled by service and instance (claims, fenced writes, reclaims, KV bytes by
    transport, prefix cache per tier, vLLM's cache_config_info and request phases), and
    between two scrapes with traffic between them no counter or histogram goes down."""
    m, _ = up
    before = run(up, scrape_mesh(m))
    for i in range(3):
        chat = {"model": "tiny", "max_tokens": 6, "pdmesh_path": "pd",   # (short: colocated)
                "messages": [{"role": "user", "content": f"item {i}: " + "data " * 30}]}
        status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
        assert status == 200, body
    after = run(up, scrape_mesh(m, after=before, grown=("pdmesh_prefill_jobs_done_total",
                                                        "pdmesh_decode_kv_received_bytes_total")))
    for series in ('pdmesh_decode_claims_granted_total{instance="decode_0",service="decode"}',
                   'pdmesh_decode_kv_writes_fenced_total{instance="decode_0"',
                   'pdmesh_decode_reclaims_total{instance="decode_0",outcome="acked"',
                   'pdmesh_prefill_kv_sent_bytes_total{instance="prefill_0",service="prefill",'
                   'transport="shm"}',
                   'pdmesh_prefill_kv_transfer_seconds_total{instance="prefill_0"',
                   'pdmesh_prefix_cache_hits_blocks_total{instance="kvstore_0",service="kvstore",'
                   'tier="l2"}',
                   'pdmesh_prefix_cache_hits_blocks_total{instance="decode_0",service="decode",'
                   'tier="l1"}',
                   'pdmesh_decode_anomalies_total{instance="decode_0",rule="repetition"',
                   'vllm:cache_config_info{block_size="16",instance="decode_0",model_name="tiny"',
                   'vllm:request_queue_time_seconds_count{model_name="tiny"}',
                   'vllm:request_prefill_time_seconds_count{model_name="tiny"}',
                   'vllm:request_decode_time_seconds_count{model_name="tiny"}'):
        assert series in after, series
    old, new = samples(before, ("counter", "histogram")), samples(after, ("counter", "histogram"))
    assert len(old) > 100
    went_down = {k: (v, new.get(k)) for k, v in old.items() if new.get(k, -1) < v}
    assert not went_down, went_down
    grew = [k for k, v in old.items() if new[k] > v]
    assert any(k[0] == "pdmesh_prefill_jobs_done_total" for k in grew), grew
    assert any(k[0] == "pdmesh_decode_kv_received_bytes_total" for k in grew), grew


async def scrape(m: UpMesh) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(m.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
            return await r.text()


def test_a_repeated_chat_computes_only_its_last_prompt_token(up):
    """vLLM's prefix cache serves whole blocks only; pdmesh's also serves a prompt's last,
    partial block (SGLang's token-level reuse): the same chat again is served all but the
    one token whose logits it samples, and answers the same."""
    m, _ = up
    chat = {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "def repeated_prompt_tail(x): return"}]}
    status, first = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
    assert status == 200, first
    status, again = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
    assert status == 200, again
    n = again["usage"]["prompt_tokens"]
    assert n % 16 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert again["choices"][0]["message"] == first["choices"][0]["message"]


def test_a_repeated_pd_prompt_answers_the_same(up):
    """Through prefill: decode's hold takes whole blocks alone (its slots must be written
    whole), prefill's job takes the tail from its own L1 and streams the block it fills."""
    m, _ = up
    chat = {"model": "tiny", "max_tokens": 8, "temperature": 0, "pdmesh_path": "pd",
            "messages": [{"role": "user", "content": "def repeated_pd_prompt_tail(y): return"}]}
    got = []
    for _ in range(3):
        status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))
        assert status == 200, body
        got.append((body["choices"][0]["message"], body["usage"]))
    assert got[0][0] == got[1][0] == got[2][0]
    n = got[2][1]["prompt_tokens"]
    assert got[2][1]["prompt_tokens_details"]["cached_tokens"] == n - 1


def test_a_crash_loop_stops_the_mesh_naming_the_child(up):
    m, _ = up
    old = m.sigkill("kvstore-0")
    run(up, m.back("kvstore-0", old))              # the first exit: started again
    m.sigkill("kvstore-0")                         # the second within the window: a loop
    deadline = time.monotonic() + 60
    while m.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert m.proc.returncode == 1, m.tail(30)
    out = m.tail(200)
    assert "kvstore-0 exited 2 times within 60 s (crash loop" in out
    assert "pdmesh: stopped" in out

