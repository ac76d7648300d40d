"""OpenTelemetry tracing across the mesh: W3C trace context in NATS headers, one trace
per request from the gateway through decode, prefill and kvstore. Off by default, and
free when off: nothing from opentelemetry is imported, no header is read or written, and
every hook below returns at its first line (`ON` is False).

    configure(cfg.otlp_endpoint, "decode")   # service_main: on when an endpoint is set
    instrument(nc)                           # every publish carries the current span's
                                             # traceparent (request, JetStream too)
    handler = traced_handler("decode", "submit", handler)   # a SERVER span per message
                                             # that arrives with a traceparent
    with span("reserve", instance=...):      # a child of the current span, named
        ...                                  # "<service> reserve"
    spans = Spans("decode"); spans.start(rid, "generate"); spans.end_all(rid)
                                             # spans that outlive one handler

On by OpenTelemetry's own variables too: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
OTEL_EXPORTER_OTLP_ENDPOINT (with OTEL_EXPORTER_OTLP_HEADERS etc., read by the exporter),
unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none; a service's own
--otlp-endpoint (or PDMESH_OTLP_ENDPOINT) wins over them. OTEL_SERVICE_NAME names every
process's service (default pdmesh-<service>; the attribute pdmesh.service always says
which), and OTEL_RESOURCE_ATTRIBUTES adds resource attributes.

Each service has a TracerProvider of its own (resource service.name = pdmesh-<service>),
so services run in one process (tests) still export as four services. `enable(processor)`
installs any span processor instead of the OTLP exporter (tests: the SDK's in-memory
exporter). The current service follows the context (a contextvar set by the server span
that started the work), so shared code (the kvstore client, the KV sender) names its spans
after the service it runs in.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdmesh.tracing")

ON = False
_processor: Any = None
_providers: dict[str, Any] = {}
_service: contextvars.ContextVar[str] = contextvars.ContextVar("pdmesh_service", default="pdmesh")
_NULL = contextlib.nullcontext()


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint -> its traces URL (http://host:4318 -> .../v1/traces)."""
    e = endpoint.rstrip("/")
    if "://" not in e:
        e = "http://" + e
    return e if e.endswith("/v1/traces") else e + "/v1/traces"


def env_endpoint(env=os.environ) -> str:
    """The traces URL OpenTelemetry's variables name ("" when they turn tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return ""
    if env.get("OTEL_TRACES_EXPORTER", "otlp").lower() in ("none", ""):
        return ""
    if url := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""):
        return url                      # the signal's own endpoint: used as it is
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return traces_url(base) if base else ""


def configure(endpoint: str, service: str) -> None:
    """Export this process's spans over OTLP/HTTP (protobuf) to `endpoint` (or where
    OpenTelemetry's variables say), batched in the background; nothing at all when
    neither names one."""
    url = traces_url(endpoint) if endpoint else env_endpoint()
    if not url:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") != "http/protobuf":
        log.warning("tracing: OTEL_EXPORTER_OTLP_PROTOCOL=%s: only http/protobuf is built "
                    "in; exporting with it", os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"])
    # endpoint given: that one; else the exporter reads OTEL_EXPORTER_OTLP_* (headers too)
    exporter = OTLPSpanExporter(endpoint=url) if endpoint else OTLPSpanExporter()
    enable(BatchSpanProcessor(exporter))
    _service.set(service)
    log.info("tracing: %s exports spans to %s", service, url)


def enable(processor) -> None:
    """Tracing on, every span through `processor` (an SDK SpanProcessor)."""
    global ON, _processor
    _processor, ON = processor, True
    _providers.clear()


def disable() -> None:
    """Tracing off (tests): spans already ended stay with their processor."""
    global ON, _processor
    shutdown()
    ON, _processor = False, None
    _providers.clear()


def shutdown() -> None:
    """Flush what is still batched (a service's last act)."""
    if ON and _processor is not None:
        try:
            _processor.force_flush(5000)
        except Exception as e:  # noqa: BLE001 - a collector away: those spans are lost
            log.warning("tracing: flush failed: %s", e)


def tracer(service: str):
    p = _providers.get(service)
    if p is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        name = os.environ.get("OTEL_SERVICE_NAME") or f"pdmesh-{service}"
        p = TracerProvider(resource=Resource.create({"service.name": name,
                                                     "pdmesh.service": service}),
                           shutdown_on_exit=False)
        p.add_span_processor(_processor)
        _providers[service] = p
    return p.get_tracer(f"pdmesh.{service}")


# ---- context across NATS -------------------------------------------------------------------


def inject(headers: dict | None) -> dict | None:
    """headers plus the current span's traceparent (a new dict; None stays None when
    there is no current span)."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return headers
    return {**(headers or {}), **carrier}


def extract(headers: dict | None):
    """The remote parent a message's headers carry (None when they carry none)."""
    if not headers or "traceparent" not in headers:
        return None
    from opentelemetry import propagate

    return propagate.extract(headers)


def instrument(nc) -> None:
    """Every message nc publishes (requests and JetStream publishes go through publish)
    carries the current span's trace context. Nothing when tracing is off."""
    if not ON:
        return
    publish = nc.publish

    async def traced_publish(subject: str, payload: bytes = b"", reply: str = "",
                             headers: dict | None = None) -> None:
        await publish(subject, payload, reply=reply, headers=inject(headers))

    nc.publish = traced_publish


# ---- spans ---------------------------------------------------------------------------------


def current_service() -> str:
    return _service.get()


@contextlib.contextmanager
def _server(service: str, name: str, parent, kind_name: str = "SERVER", **attrs):
    from opentelemetry.trace import SpanKind

    token = _service.set(service)
    try:
        with tracer(service).start_as_current_span(f"{service} {name}", context=parent,
                                                   kind=getattr(SpanKind, kind_name),
                                                   attributes=_attrs(attrs)) as s:
            yield s
    finally:
        _service.reset(token)


def server(service: str, name: str, headers: dict | None, kind: str = "SERVER", **attrs):
    """A span for work a message started: a child of the trace its headers carry. No
    span (a null context) when tracing is off or the message carries no trace."""
    if not ON:
        return _NULL
    parent = extract(headers)
    if parent is None:
        return _NULL
    return _server(service, name, parent, kind, **attrs)


def root(service: str, name: str, headers: dict | None = None, **attrs):
    """A span that starts a trace (or continues the one `headers` carry): the gateway's
    HTTP request."""
    if not ON:
        return _NULL
    return _server(service, name, extract(headers), "SERVER", **attrs)


def traced_handler(service: str, name: str, handler: Callable) -> Callable:
    """handler(req) inside server(service, name, req.headers); handler itself when off."""
    if not ON:
        return handler

    async def traced(req) -> None:
        with server(service, name, req.headers):
            await handler(req)

    return traced


def span(name: str, kind: str = "INTERNAL", start_time: int | None = None, **attrs):
    """A child of the current span, "<service> <name>"; a null context when tracing is
    off or nothing is being traced here."""
    if not ON:
        return _NULL
    from opentelemetry import trace

    if not trace.get_current_span().get_span_context().is_valid:
        return _NULL
    svc = _service.get()
    return tracer(svc).start_as_current_span(
        f"{svc} {name}", kind=getattr(trace.SpanKind, kind), start_time=start_time,
        attributes=_attrs(attrs))


def set_attrs(**attrs) -> None:
    """Attributes on the current span (nothing when off)."""
    if not ON:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(_attrs(attrs))


def _attrs(attrs: dict) -> dict:
    return {f"pdmesh.{k}": v for k, v in attrs.items() if v is not None}


class Spans:
    """Spans that outlive one handler, by key (decode: a request's wait for its KV, its
    generation). The first start() for a key anchors it to the current span; every span
    of the key is a child of that anchor, wherever it starts. end_all(key) ends whatever
    the key still has open (finish, abort, failure alike)."""

    def __init__(self, service: str):
        self.service = service
        self.open: dict[str, tuple[Any, dict[str, Any]]] = {}

    def start(self, key: str, name: str, **attrs) -> None:
        if not ON:
            return
        from opentelemetry import context, trace

        if key not in self.open:
            if not trace.get_current_span().get_span_context().is_valid:
                return
            self.open[key] = (context.get_current(), {})
        anchor, spans = self.open[key]
        spans[name] = tracer(self.service).start_span(
            f"{self.service} {name}", context=anchor, attributes=_attrs(attrs))

    def end(self, key: str, name: str, **attrs) -> None:
        if not ON or key not in self.open:
            return
        s = self.open[key][1].pop(name, None)
        if s is not None:
            s.set_attributes(_attrs(attrs))
            s.end()

    def end_all(self, key: str, **attrs) -> None:
        if not ON:
            return
        for s in self.open.pop(key, (None, {}))[1].values():
            s.set_attributes(_attrs(attrs))
            s.end()


def interval(name: str, start_ns: int | None, **attrs) -> None:
    """A child span of the current one from start_ns (time.time_ns) to now: a wait that
    began elsewhere (a job's time in the work queue)."""
    if not ON or start_ns is None:
        return
    with span(name, start_time=start_ns, **attrs):
        pass
