"""Prometheus text exposition (format 0.0.4), hand-written: counters, histograms, gauges.

    m = Metrics()
    m.requests.inc(path="/v1/chat/completions", status="200")
    m.ttft.observe(0.12)
    m.render(gauges={"pdmesh_requests_in_flight": (help, 3)}) -> str
"""
from __future__ import annotations

import bisect
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class Counter:
    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def total(self) -> float:
        return sum(self.values.values())

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return out


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help_
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)   # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for bound, c in zip((*self.bounds, math.inf), self.counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_num(float(bound))}"}} {cum}')
        out += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.requests = Counter("pdmesh_requests_total", "HTTP requests by route and status.")
        self.failures = Counter("pdmesh_request_failures_total",
                                "Accepted requests that ended in an error, by error code.")
        self.placements = Counter("pdmesh_placements_total",
                                  "Requests accepted by decode, by placement (pd|colocated).")
        self.ttft = Histogram("pdmesh_time_to_first_token_seconds",
                              "Request arrival to first generated token.", TTFT_BUCKETS)
        self.prompt_tokens = Counter("pdmesh_prompt_tokens_total",
                                     "Prompt tokens of finished requests.")
        self.cached_tokens = Counter("pdmesh_prompt_tokens_cached_total",
                                     "Prompt tokens served from a prefix cache (L1/L2/L3), "
                                     "not computed.")
        self.itl = Histogram("pdmesh_inter_token_latency_seconds",
                             "Time between generated tokens of one request.", ITL_BUCKETS)
        self.spec_accept_length = Histogram(
            "pdmesh_spec_accept_length", "Speculative decoding: mean tokens per verification "
            "step of each finished request (the bonus/correction token included).",
            ACCEPT_LENGTH_BUCKETS)
        self.anomaly_aborts = Counter("pdmesh_anomaly_aborts_total",
                                      "Requests decode aborted for a speculative-acceptance "
                                      "anomaly, by monitor rule.")
        self.redispatches = Counter("pdmesh_redispatches_total",
                                    "Anomaly-aborted requests sent to another decode instance.")
        self.redispatches.inc(0)       # exposed from the start
        self.migrations = Counter("pdmesh_migrations_total",
                                  "Requests moved to another decode instance after theirs was "
                                  "lost (dead, silent, or a chunk went missing), by reason.")

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        lines: list[str] = []
        for m in (self.requests, self.failures, self.placements, self.prompt_tokens,
                  self.cached_tokens, self.anomaly_aborts, self.redispatches, self.migrations,
                  self.ttft,
                  self.itl, self.spec_accept_length):
            lines += m.render()
        for name, (help_, value) in gauges.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {_num(value)}"]
        return "\n".join(lines) + "\n"
