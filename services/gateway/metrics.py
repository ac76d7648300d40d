"""The gateway's Prometheus metrics, through prometheus_client: counters and histograms in
a CollectorRegistry of the gateway's own (several gateways in one process never share
one), plus gauges read when /metrics is scraped.

    m = Metrics()
    m.requests.inc(path="/v1/chat/completions", status="200")
    m.ttft.observe(0.12)
    m.render(gauges={"pdmesh_requests_in_flight": (help, 3)}) -> str   (format 0.0.4)

A gauge whose name ends in `_total` is exposed as a counter (it only grows).
"""
from __future__ import annotations

from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter as _PCounter, Histogram as _PHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)

prometheus_client.disable_created_metrics()     # no *_created series: the old exposition had none


class Counter:
    """A prometheus_client Counter with its label names fixed at creation:
    inc(amount, **labels) and total() (over every label set)."""

    def __init__(self, name: str, help_: str, labels: tuple[str, ...] = (),
                 registry: CollectorRegistry | None = None):
        self.labelnames = labels
        self._c = _PCounter(name.removesuffix("_total"), help_, labels, registry=registry)

    def inc(self, amount: float = 1, **labels: str) -> None:
        (self._c.labels(**labels) if self.labelnames else self._c).inc(amount)

    def total(self) -> float:
        return sum(s.value for m in self._c.collect() for s in m.samples
                   if s.name.endswith("_total"))


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry | None = None):
        self._h = _PHistogram(name, help_, buckets=buckets, registry=registry)

    def observe(self, v: float, n: int = 1) -> None:
        """n observations of v (e.g. the mean gap of n tokens that arrived together)."""
        for _ in range(n):
            self._h.observe(v)


class _Scrape:
    """One scrape: the registry's metrics, then these gauges (read now)."""

    def __init__(self, registry: CollectorRegistry, gauges: dict[str, tuple[str, float]]):
        self.registry, self.gauges = registry, gauges

    def collect(self) -> Iterable[Metric]:
        yield from self.registry.collect()
        for name, (help_, value) in self.gauges.items():
            if isinstance(value, dict):       # {instance: value}: one sample per instance
                g = GaugeMetricFamily(name, help_, labels=["instance"])
                for inst, v in sorted(value.items()):
                    g.add_metric([inst], v)
                yield g
            elif name.endswith("_total"):
                yield CounterMetricFamily(name, help_, value=value)
            else:
                yield GaugeMetricFamily(name, help_, value=value)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pdmesh_requests_total", "HTTP requests by route and status.",
                                ("path", "status"), r)
        self.failures = Counter("pdmesh_request_failures_total",
                                "Accepted requests that ended in an error, by error code.",
                                ("code",), r)
        self.placements = Counter("pdmesh_placements_total",
                                  "Requests accepted by decode, by placement (pd|colocated).",
                                  ("placement",), r)
        self.ttft = Histogram("pdmesh_time_to_first_token_seconds",
                              "Request arrival to first generated token.", TTFT_BUCKETS, r)
        self.prompt_tokens = Counter("pdmesh_prompt_tokens_total",
                                     "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("pdmesh_prompt_tokens_cached_total",
                                     "Prompt tokens served from a prefix cache (L1/L2/L3), "
                                     "not computed.", registry=r)
        self.itl = Histogram("pdmesh_inter_token_latency_seconds",
                             "Time between generated tokens of one request.", ITL_BUCKETS, r)
        self.spec_accept_length = Histogram(
            "pdmesh_spec_accept_length", "Speculative decoding: mean tokens per verification "
            "step of each finished request (the bonus/correction token included).",
            ACCEPT_LENGTH_BUCKETS, r)
        self.anomaly_aborts = Counter("pdmesh_anomaly_aborts_total",
                                      "Requests decode aborted for a speculative-acceptance "
                                      "anomaly, by monitor rule.", ("rule",), r)
        self.redispatches = Counter("pdmesh_redispatches_total",
                                    "Anomaly-aborted requests sent to another decode instance.",
                                    registry=r)
        self.migrations = Counter("pdmesh_migrations_total",
                                  "Requests moved to another decode instance after theirs was "
                                  "lost (dead, silent, or a chunk went missing), by reason.",
                                  ("reason",), r)
        self.choices = Counter("pdmesh_choices_total",
                               "Choices generated for requests with n > 1 (each a generation "
                               "of its own sharing the prompt's cached blocks).", registry=r)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition (text format 0.0.4): every counter and histogram, then `gauges`
        (name -> (help, value), read at this scrape)."""
        return generate_latest(_Scrape(self.registry, gauges)).decode()
