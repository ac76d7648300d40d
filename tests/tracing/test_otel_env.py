"""Tracing turns on by OpenTelemetry's own variables (shared/tracing.env_endpoint), off by
its switches, and a service's --otlp-endpoint wins over them."""
from __future__ import annotations

import pytest

from shared import tracing

BASE = "http://collector:4318"


@pytest.mark.parametrize("env,url", [
    ({}, ""),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE}, BASE + "/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE + "/"}, BASE + "/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/custom"}, "http://t:1/custom"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE,
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}, "http://t:1/x"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE, "OTEL_SDK_DISABLED": "true"}, ""),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE, "OTEL_TRACES_EXPORTER": "none"}, ""),
])
def test_the_standard_variables_name_the_endpoint(env, url):
    assert tracing.env_endpoint(env) == url


def test_configure_follows_the_environment_and_the_flag_wins(monkeypatch):
    calls = []
    monkeypatch.setattr(tracing, "enable", lambda processor: calls.append(processor))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    tracing.configure("", "decode")
    assert calls == []                                  # nothing set: off, nothing built
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracing.configure("", "decode")
    assert calls[-1].span_exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    tracing.configure("http://127.0.0.1:7", "decode")
    assert calls[-1].span_exporter._endpoint == "http://127.0.0.1:7/v1/traces"
    for p in calls:
        p.shutdown()
