"""Pure cores of the gateway: the decode registry (liveness, least-loaded choice) and the
Prometheus text it serves."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import Metrics
from services.gateway.registry import Registry
from shared.contracts.messages import Heartbeat


def hb(iid: str, **kw) -> Heartbeat:
    return Heartbeat(service=kw.pop("service", "decode"), instance_id=iid, **kw)


def test_least_loaded_not_round_robin():
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a", running=4, waiting=1), now=0.0)
    r.observe(hb("b", running=1, queue_depth=1), now=0.0)
    r.observe(hb("c", running=3), now=0.0)
    assert [r.choose(1.0) for _ in range(2)] == ["b", "b"]   # load does not change without sends
    r.sent("b")
    r.sent("b")                        # b: 2 + 2 sent since its heartbeat = 4 > c's 3
    assert r.choose(1.0) == "c"
    r.observe(hb("b", running=1, queue_depth=1), now=1.5)   # a heartbeat resets the local count
    assert r.choose(1.5) == "b"


def test_requests_that_ended_before_the_next_heartbeat_are_not_load():
    """Short requests one after another, faster than heartbeats: each one that ended no
    longer counts (else six of them make a warm, idle instance look busy and the seventh
    loses its cache affinity); one still running does, until a heartbeat counts it."""
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a"), now=0.0)
    r.observe(hb("b"), now=0.0)
    for _ in range(6):
        beat = r.sent("a")
        r.ended("a", beat)
    assert r.choose(0.5, cached={"a": 512}) == "a"
    assert r.instances["a"].load == 0
    running = [r.sent("a") for _ in range(5)]              # five still running
    assert r.choose(0.5, cached={"a": 512}) == "b"         # 5 > 0 + max_extra_load
    r.observe(hb("a", running=5), now=1.0)                 # the heartbeat counts them now
    for beat in running:
        r.ended("a", beat)                                 # ...so these change nothing
    assert r.instances["a"].load == 5
    r.ended("a", None)                                     # unknown: nothing
    r.ended("zzz", 1)


def test_ties_go_to_more_free_blocks_and_exclude_is_honoured():
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a", running=1, blocks_free=10), now=0.0)
    r.observe(hb("b", running=1, blocks_free=50), now=0.0)
    assert r.choose(0.0) == "b"
    assert r.choose(0.0, exclude={"b"}) == "a"
    assert r.choose(0.0, exclude={"a", "b"}) is None
    assert "tried" in r.why_none(0.0, {"a", "b"})


def test_a_preferred_instance_wins_while_it_is_a_candidate():
    """n > 1: choices 1..n-1 go where choice 0's prompt is cached, however loaded."""
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a", running=9), now=0.0)
    r.observe(hb("b"), now=0.0)
    assert r.choose(1.0, prefer="a") == "a"
    assert r.choose(1.0, exclude={"a"}, prefer="a") == "b"      # tried already
    assert r.choose(5.0, prefer="a") is None                      # dead: nobody (both are)
    r.observe(hb("b"), now=4.0)
    assert r.choose(5.0, prefer="a") == "b"                       # dead: the usual choice


def test_liveness_by_last_heartbeat():
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a"), now=10.0)
    r.observe(hb("p", service="prefill"), now=10.0)    # only decode instances are books
    assert r.is_alive("a", 12.9) and not r.is_alive("a", 13.1) and not r.is_alive("p", 10.0)
    assert r.choose(13.1) is None and "no decode instance" in r.why_none(13.1)
    assert r.silent_for("a", 14.0) == 4.0


def test_other_tokenizer_is_not_chosen():
    r = Registry(dead_after_s=3.0, fingerprint="mine")
    r.observe(hb("a", tokenizer_fingerprint="theirs"), now=0.0)
    assert r.choose(0.0) is None and "different tokenizer" in r.why_none(0.0)
    r.observe(hb("b", tokenizer_fingerprint=""), now=0.0)      # unknown: allowed
    assert r.choose(0.0) == "b"


def test_totals_sum_live_instances_only():
    r = Registry(dead_after_s=3.0)
    r.observe(hb("a", queue_depth=2, blocks_used=5, blocks_free=1), now=0.0)
    r.observe(hb("b", queue_depth=3, blocks_used=7, blocks_free=2), now=2.0)
    assert r.totals(2.5) == {"instances": 2, "running": 0, "waiting": 0, "queue_depth": 5,
                            "blocks_free": 3, "blocks_used": 12, "blocks_quarantined": 0}
    assert r.totals(4.0)["blocks_used"] == 7


def test_prometheus_text():
    """prometheus_client does the exposition; every gateway has a registry of its own."""
    m = Metrics()
    m.requests.inc(path='/a"b', status="200")
    m.requests.inc(path='/a"b', status="200")
    m.itl.observe(0.05)
    m.itl.observe(0.1)          # le is inclusive
    m.itl.observe(5.0, n=2)
    text = m.render({"g": ("A gauge.", 3), "x_total": ("Grows.", 7)})
    assert "# TYPE pdmesh_requests_total counter" in text
    assert 'pdmesh_requests_total{path="/a\\"b",status="200"} 2.0' in text
    assert m.requests.total() == 2
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    itl = {(s.name, s.labels.get("le")): s.value
           for s in fams["pdmesh_inter_token_latency_seconds"].samples}
    assert itl[("pdmesh_inter_token_latency_seconds_bucket", "0.1")] == 2
    assert itl[("pdmesh_inter_token_latency_seconds_bucket", "+Inf")] == 4
    assert itl[("pdmesh_inter_token_latency_seconds_count", None)] == 4
    assert abs(itl[("pdmesh_inter_token_latency_seconds_sum", None)] - 10.15) < 1e-9
    assert fams["g"].type == "gauge" and fams["g"].samples[0].value == 3
    assert fams["x"].type == "counter" and fams["x"].samples[0].value == 7
    assert "pdmesh_redispatches_total 0.0" in text          # exposed from the start
    assert "_created" not in text
    other = Metrics()                                      # a second gateway: its own registry
    assert other.requests.total() == 0 and "status=" not in other.render({})


def test_vllm_series_with_the_model_name():
    """The names and labels a vLLM dashboard reads, beside pdmesh's own."""
    m = Metrics("my-model")
    m.vllm.ttft.observe(0.2)
    m.vllm.finished(prompt=10, generated=5, cached=4, reason="stop", e2e_s=1.5)
    m.vllm.finished(prompt=6, generated=2, cached=0, reason="length", e2e_s=0.5)
    text = m.render(m.vllm.gauges(running=3, waiting=1, used=30, free=90))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    mn = (("model_name", "my-model"),)
    assert samples[("vllm:time_to_first_token_seconds_count", mn)] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", mn)] == 2
    assert samples[("vllm:prompt_tokens_total", mn)] == 16
    assert samples[("vllm:generation_tokens_total", mn)] == 7
    assert samples[("vllm:prefix_cache_queries_total", mn)] == 16
    assert samples[("vllm:prefix_cache_hits_total", mn)] == 4
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "stop"), ("model_name", "my-model")))] == 1
    assert samples[("vllm:num_requests_running", mn)] == 3
    assert samples[("vllm:num_requests_waiting", mn)] == 1
    assert samples[("vllm:kv_cache_usage_perc", mn)] == 0.25
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["vllm:generation_tokens"] == "counter"       # counters stay counters
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
