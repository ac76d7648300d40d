"""Tracing across processes: every service of a real mesh (separate processes, real
nats-server) exports its spans over OTLP/HTTP to the collector this test runs, turned on
by OpenTelemetry's own OTEL_EXPORTER_OTLP_ENDPOINT alone, and one PD request arrives as
one connected trace from all four services (the context crossed NATS in each message's
traceparent header), its root carrying the GenAI semantic conventions."""
from __future__ import annotations

import asyncio
import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

from pdmesh.local.cluster import Cluster

from .conftest import DET, det_overrides

SERVICES = {"pdmesh-gateway", "pdmesh-decode", "pdmesh-prefill", "pdmesh-kvstore"}


class Collector:
    """An OTLP/HTTP (protobuf) trace receiver on a free port: (service, span) pairs."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        lock, spans = threading.Lock(), self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                req = pb.ExportTraceServiceRequest.FromString(data)
                with lock:
                    for rs in req.resource_spans:
                        name = next(a.value.string_value for a in rs.resource.attributes
                                    if a.key == "service.name")
                        spans.extend((name, s) for ss in rs.scope_spans for s in ss.spans)
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        return [(svc, s) for svc, s in list(self.spans) if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.shutdown()


async def request(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "pdmesh_path": "pd"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-pdmesh-path"] == "pd"


def test_every_service_exports_the_same_connected_trace(tiny_target, tiny_tokenizer, collector):
    prompt = tiny_tokenizer.encode("def traced_across_processes(a, b):\n    return a + b\n" * 4)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=det_overrides(),
                 extra_env=env, echo=False) as mesh:
        asyncio.run(request(mesh.url, prompt))
        deadline, spans = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            roots = [s for svc, s in collector.spans if svc == "pdmesh-gateway"
                     and s.name == "gateway POST /v1/completions"]
            spans = collector.trace(roots[0].trace_id) if roots else []
            ids = {s.span_id for _, s in spans}
            # every service, the write-back, and every parent: a span is exported when it
            # ends, so a parent can reach the collector after its children
            if {svc for svc, _ in spans} == SERVICES and any(
                    s.name == "kvstore put" for _, s in spans) and all(
                    s.parent_span_id in ids for _, s in spans if s.parent_span_id):
                break
            time.sleep(0.2)
    assert {svc for svc, _ in spans} == SERVICES, sorted({(svc, s.name) for svc, s in spans})
    ids = {s.span_id for _, s in spans}
    assert [s.name for _, s in spans if not s.parent_span_id] == ["gateway POST /v1/completions"]
    assert all(s.parent_span_id in ids for _, s in spans if s.parent_span_id)
    (root,) = [s for _, s in spans if not s.parent_span_id]
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.operation.name"].string_value == "text_completion"
    assert attrs["gen_ai.request.model"].string_value == "tiny-target"
    assert attrs["gen_ai.request.max_tokens"].int_value == 4
    assert attrs["gen_ai.usage.input_tokens"].int_value == len(prompt)
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert attrs["gen_ai.response.id"].string_value.startswith("cmpl-")
    assert [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values
            ] == ["length"]
    names = {s.name for _, s in spans}
    for name in ("decode submit", "prefill queue", "prefill claim", "decode claim",
                 "prefill compute", "prefill kv_transfer", "decode kv", "decode generate",
                 "kvstore lookup"):
        assert name in names, sorted(names)
