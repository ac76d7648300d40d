"""The gateway's Prometheus metrics, through prometheus_client: counters and histograms in
a CollectorRegistry of the gateway's own (several gateways in one process never share
one), plus gauges read when /metrics is scraped.

    m = Metrics()
    m.requests.inc(path="/v1/chat/completions", status="200")
    m.ttft.observe(0.12)
    m.render(gauges={"pdmesh_requests_in_flight": (help, 3)}) -> str   (format 0.0.4)

A gauge whose name ends in `_total` is exposed as a counter (it only grows); a gauge's
value may be {((label, value), ...): number} for labelled samples.

Beside the `pdmesh_*` names, the series a vLLM dashboard (and the Gateway API Inference
Extension's model-server protocol) reads, under vLLM's names with a `model_name` label:
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_{queue,prefill,decode,inference}_time_seconds`
(histograms; the phases on decode's clock), `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
`vllm:prefix_cache_queries_total` / `_hits_total` (prompt tokens looked up / served from a
prefix cache), and at each scrape `vllm:num_requests_running` / `_waiting` and
`vllm:kv_cache_usage_perc` (a ratio, 0..1) over the decode instances' heartbeats.
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
                 registry: CollectorRegistry | None = None, labels: dict[str, str] | None = None):
        """labels: fixed label values (vLLM's model_name)."""
        h = _PHistogram(name, help_, tuple(labels or ()), buckets=buckets, registry=registry)
        self._h = h.labels(**labels) if labels else h

    def observe(self, v: float, n: int = 1) -> None:
        """n observations of v (e.g. the mean gap of n tokens that arrived together)."""
        for _ in range(n):
            self._h.observe(v)


E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1) + E2E_BUCKETS
PHASES = {"queue": "Time in the decode instance's queue: accepted until its prompt began "
                   "(a prefill worker claimed it, or its first step there).",
          "prefill": "Time in prefill: the prompt began until its first token.",
          "decode": "Time in decode: the first token until the last.",
          "inference": "Time in prefill and decode (queue time excluded)."}


class VllmSeries:
    """vLLM's request-level series for one served model (model_name label)."""

    def __init__(self, model_name: str, r: CollectorRegistry):
        m = {"model_name": model_name}
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS, r, m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             ITL_BUCKETS, r, m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency.",
                             E2E_BUCKETS, r, m)
        self.phases = {k: Histogram(f"vllm:request_{k}_time_seconds", h, PHASE_BUCKETS, r, m)
                       for k, h in PHASES.items()}
        self._prompt = _PCounter("vllm:prompt_tokens", "Prefill tokens processed.",
                                 ["model_name"], registry=r).labels(**m)
        self._generation = _PCounter("vllm:generation_tokens", "Generation tokens processed.",
                                     ["model_name"], registry=r).labels(**m)
        self._success = _PCounter("vllm:request_success", "Successfully finished requests.",
                                  ["model_name", "finished_reason"], registry=r)
        self._queries = _PCounter("vllm:prefix_cache_queries",
                                  "Prompt tokens looked up in a prefix cache.", ["model_name"],
                                  registry=r).labels(**m)
        self._hits = _PCounter("vllm:prefix_cache_hits",
                               "Prompt tokens served from a prefix cache.", ["model_name"],
                               registry=r).labels(**m)

    def finished(self, prompt: int, generated: int, cached: int, reason: str,
                 e2e_s: float) -> None:
        self._prompt.inc(prompt)
        self._generation.inc(generated)
        self._queries.inc(prompt)
        self._hits.inc(cached)
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.e2e.observe(e2e_s)

    def phased(self, queue_s: float, prefill_s: float, decode_s: float) -> None:
        """A finished request's phases (the final chunk's queue_s, prefill_s, decode_s)."""
        for k, v in (("queue", queue_s), ("prefill", prefill_s), ("decode", decode_s),
                     ("inference", prefill_s + decode_s)):
            self.phases[k].observe(v)

    def gauges(self, running: int, waiting: int, used: int, free: int) -> dict:
        """The scrape-time series, for Metrics.render (value: {labels: value})."""
        m = (("model_name", self.model_name),)
        return {"vllm:num_requests_running": ("Requests in the decode batches.",
                                              {m: running}),
                "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", {m: waiting}),
                "vllm:kv_cache_usage_perc": ("KV cache usage (1 means 100 percent).",
                                             {m: used / (used + free) if used + free else 0.0})}


class _Scrape:
    """One scrape: the registry's metrics, then these gauges (read now)."""

    def __init__(self, registry: CollectorRegistry, gauges: dict[str, tuple[str, float]]):
        self.registry, self.gauges = registry, gauges

    def collect(self) -> Iterable[Metric]:
        yield from self.registry.collect()
        for name, (help_, value) in self.gauges.items():
            if isinstance(value, dict) and value and isinstance(next(iter(value)), tuple):
                labels = [k for k, _ in next(iter(value))]     # {((label, v), ...): value}
                family = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                g = family(name, help_, labels=labels)
                for key, v in value.items():
                    g.add_metric([lv for _, lv in key], v)
                yield g
            elif isinstance(value, dict):       # {instance: value}: one sample per instance
                g = GaugeMetricFamily(name, help_, labels=["instance"])
                for inst, v in sorted(value.items()):
                    g.add_metric([inst], v)
                yield g
            elif name.endswith("_total"):
                yield CounterMetricFamily(name, help_, value=value)
            else:
                yield GaugeMetricFamily(name, help_, value=value)


class Metrics:
    def __init__(self, model_name: str = "pdmesh"):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.vllm = VllmSeries(model_name, r)
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
