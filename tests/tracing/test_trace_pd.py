"""OpenTelemetry tracing (shared/tracing.py): one PD request is one connected trace across
the gateway, decode, prefill and kvstore, its context carried in NATS headers (W3C
traceparent), with spans for the job's time in the queue, the claim, prefill compute,
the KV transfer, cache lookups and loads, and decode; the SDK's in-memory exporter
collects every service's spans. Off (the default), nothing of opentelemetry is imported
and no message carries a header for it."""
from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import tracing

from .mesh import local_mesh

pytestmark = pytest.mark.timeout(180)

SERVICES = {"pdmesh-gateway", "pdmesh-decode", "pdmesh-prefill", "pdmesh-kvstore"}


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    tracing.enable(SimpleSpanProcessor(exp))
    yield exp
    tracing.disable()


def service(s) -> str:
    return s.resource.attributes["service.name"]


def by_trace(spans) -> dict[int, list]:
    out: dict[int, list] = {}
    for s in spans:
        out.setdefault(s.context.trace_id, []).append(s)
    return out


def assert_connected(spans) -> dict[str, list]:
    """One root; every other span's parent is a span of the same trace. Returns the
    spans by name."""
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["gateway POST /v1/completions"], roots
    orphans = [s.name for s in spans if s.parent is not None and s.parent.span_id not in ids]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    named: dict[str, list] = {}
    for s in spans:
        named.setdefault(s.name, []).append(s)
    return named


def parent(named, s):
    return next(p.name for ps in named.values() for p in ps
                if p.context.span_id == s.parent.span_id)


async def settle(exp, name: str, count: int = 1, wait_s: float = 10.0) -> list:
    """Spans once `count` spans called `name` ended (background work: write-back)."""
    deadline = time.monotonic() + wait_s
    while sum(s.name == name for s in exp.get_finished_spans()) < count:
        assert time.monotonic() < deadline, f"no '{name}' span within {wait_s}s"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return list(exp.get_finished_spans())


def prompt(tok) -> list[int]:
    return tok.encode("# traced\n" + inspect.getsource(json))[:100]


async def complete(http, ids) -> dict:
    r = await http.post("/v1/completions", json={
        "model": "tiny-target", "prompt": ids, "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True, "pdmesh_path": "pd"})
    body = await r.json()
    assert r.status == 200, body
    assert r.headers["x-pdmesh-path"] == "pd"
    return body


async def test_one_pd_request_is_one_connected_trace_across_all_four_services(
        exporter, nats_url, tiny_target, tiny_tokenizer, tmp_path):
    async with local_mesh(nats_url, tiny_target, tmp_path) as (http, _svcs):
        await complete(http, prompt(tiny_tokenizer))
        spans = await settle(exporter, "kvstore put")      # the write-back, after the answer
    traces = by_trace(spans)
    assert len(traces) == 1, {t: sorted(s.name for s in ss) for t, ss in traces.items()}
    named = assert_connected(spans)
    assert {service(s) for s in spans} == SERVICES
    for name in ("gateway submit", "decode submit", "decode reserve", "decode cache_lookup",
                 "kvstore lookup", "decode await_kv", "prefill job", "prefill queue",
                 "prefill claim", "decode claim", "prefill compute",
                 "prefill kv_transfer", "decode kv", "decode generate",
                 "kvstore put"):
        assert name in named, f"no '{name}' span in {sorted(named)}"
    edges = {("gateway submit", "gateway POST /v1/completions"),
             ("decode submit", "gateway submit"), ("prefill job", "decode submit"),
             ("decode await_kv", "decode submit"), ("decode generate", "decode submit"),
             ("prefill queue", "prefill job"), ("prefill claim", "prefill job"),
             ("decode claim", "prefill claim"), ("prefill compute", "prefill job"),
             ("decode cache_lookup", "decode submit"),
             ("prefill kv_transfer", "prefill job")}
    for child, want in edges:
        assert {parent(named, s) for s in named[child]} == {want}, (child, want)
    # kvstore is asked once, by decode: the job carries its answer to prefill
    assert {parent(named, s) for s in named["kvstore lookup"]} == {"decode cache_lookup"}
    assert "prefill cache_lookup" not in named and len(named["kvstore lookup"]) == 1
    assert {parent(named, s) for s in named["kvstore put"]} <= {"prefill job", "decode generate"}
    # KV writes: from the transfer, or (layer-wise streaming) while the prompt computes
    assert {parent(named, s) for s in named["decode kv"]} <= {"prefill kv_transfer",
                                                              "prefill compute", "prefill job"}
    # ordering: the queue wait ends before the claim; decoding starts after the transfer
    q, claim = named["prefill queue"][0], named["prefill claim"][0]
    assert q.start_time <= q.end_time <= claim.start_time
    # (the prompt's KV is one write, carrying its PrefillDone: decode starts on that write,
    # so no separate prefill_done span)
    assert "decode prefill_done" not in named
    assert named["decode generate"][0].start_time >= named["decode kv"][0].start_time
    assert named["decode generate"][0].attributes["pdmesh.path"] == "pd"


async def test_a_cache_load_is_traced_down_to_kvstore(exporter, nats_url, tiny_target,
                                                      tiny_tokenizer, tmp_path):
    """L1 off on both engines: the second request's prefix comes from kvstore (L2), loaded
    layer by layer; the load and kvstore's fetch and layer pulls are in its trace."""
    ids = prompt(tiny_tokenizer)
    async with local_mesh(nats_url, tiny_target, tmp_path, prefix_cache=False) as (http, _s):
        first = await complete(http, ids)
        await settle(exporter, "kvstore put")
        exporter.clear()
        second = await complete(http, ids)
        spans = await settle(exporter, "decode generate")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    traces = [ss for ss in by_trace(spans).values()
              if any(s.name == "gateway POST /v1/completions" for s in ss)]
    assert len(traces) == 1
    named = assert_connected(traces[0])
    loads = [n for n in named if n.endswith(" cache_load")]
    assert loads, sorted(named)
    assert {parent(named, s) for s in named["kvstore fetch"]} <= {n for n in loads}
    assert named["kvstore layer"], "no layer pull traced"
    assert {parent(named, s) for s in named["kvstore layer"]} <= set(loads)


def test_off_by_default_imports_nothing_and_adds_no_header():
    """No endpoint: no opentelemetry module is imported by any service, the handlers
    are the undecorated ones, and nc.publish is nats-py's own."""
    code = """
import sys
from shared import tracing
import services.gateway.app, services.decode.service, services.prefill.service
import services.kvstore.service, shared.settings
tracing.configure("", "decode")
assert not tracing.ON
h = lambda req: None
assert tracing.traced_handler("decode", "submit", h) is h
class NC:
    async def publish(self, *a, **k): pass
nc = NC(); tracing.instrument(nc); assert "publish" not in vars(nc)
assert tracing.span("x") is tracing.server("d", "x", {"traceparent": "00-1-2-01"})
otel = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not otel, otel
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_traces_url():
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/v1/traces") == "https://c/v1/traces"
