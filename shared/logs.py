"""How every pdmesh process logs: text for a terminal, or JSON lines for a log pipeline.

    PDMESH_LOG=debug|info|warning|error   the level (default info)
    PDMESH_LOG_FORMAT=text|json           the shape (default text; `pdmesh up --log-format`)

A JSON line is one object: time (ISO 8601, UTC), level, service, instance, logger,
message, and, when known, request_id (the request being handled: `request_context`) and
trace_id (the current OpenTelemetry span's, when tracing is on); an exception adds its
traceback as `exc`. A record's `extra={"fields": {...}}` adds fields of its own (the
gateway's access log: status, tokens, TTFT).
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import os
import sys

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_request: contextvars.ContextVar[str] = contextvars.ContextVar("pdmesh_request", default="")
_who = {"service": "pdmesh", "instance": ""}


@contextlib.contextmanager
def request_context(request_id: str):
    """Log records made inside carry this request id (JSON: request_id)."""
    token = _request.set(request_id)
    try:
        yield
    finally:
        _request.reset(token)


def set_identity(service: str | None = None, instance: str | None = None) -> None:
    if service:
        _who["service"] = service
    if instance:
        _who["instance"] = instance


def _trace_id() -> str:
    from shared import tracing
    if not tracing.ON:
        return ""
    from opentelemetry import trace
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "service": _who["service"],
               "instance": _who["instance"], "logger": record.name,
               "message": record.getMessage()}
        if rid := _request.get():
            out["request_id"] = rid
        if tid := _trace_id():
            out["trace_id"] = tid
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup(service: str | None = None, level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger once per process, from the arguments or the environment.
    An unknown format falls back to text with a warning (logging must never stop a start)."""
    set_identity(service)
    fmt = (fmt or os.environ.get("PDMESH_LOG_FORMAT") or "text").lower()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("PDMESH_LOG") or "INFO").upper())
    if fmt not in FORMATS:
        logging.getLogger("pdmesh").warning("PDMESH_LOG_FORMAT=%s: not one of %s; text",
                                            fmt, "/".join(FORMATS))
