"""The gateway federates every service's STATS into its /metrics (scrape.federate): one
sample per instance, labelled service and instance, counters typed as counters."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import Metrics
from services.gateway.scrape import federate
from shared.micro import Instance


def inst(service: str, iid: str, **stats) -> Instance:
    return Instance(service=service, id=iid + "-x", instance_id=iid, version="1", stats=stats)


DECODE = dict(claims_granted=5, claims_refused=2, kv_writes_applied=9, kv_writes_fenced=1,
              kv_bytes=4096, reclaims_by_outcome={"acked": 3}, aborts_by_reason={"client": 1},
              anomaly_repetition=4, l1_query_blocks=10, l1_hit_blocks=6, block_size=16,
              blocks_total=100, running=2, blocks_quarantined=7)
PREFILL = dict(jobs_done=8, kv_bytes=1000, kv_shm_bytes=600, kv_writes=5, kv_shm_writes=3,
               kv_transfer_s=0.25, l1_query_blocks=4, l1_hit_blocks=1)
KVSTORE = dict(lookup_keys=12, l2_hits=5, l3_hits=2, l2_entries=9)


def families(found) -> dict:
    text = Metrics("m").render(federate(found, "m"))
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(fam) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples}


def test_each_instance_is_its_own_sample_labelled_by_service_and_instance():
    f = families({"decode": [inst("decode", "d0", **DECODE),
                             inst("decode", "d1", **DECODE | {"claims_refused": 9})],
                  "prefill": [inst("prefill", "p0", **PREFILL)],
                  "kvstore": [inst("kvstore", "k0", **KVSTORE)]})
    refused = f["pdmesh_decode_claims_refused"]
    assert refused.type == "counter"
    assert values(refused) == {(("instance", "d0"), ("service", "decode")): 2.0,
                               (("instance", "d1"), ("service", "decode")): 9.0}
    assert f["pdmesh_decode_blocks_quarantined"].type == "gauge"
    reclaims = values(f["pdmesh_decode_reclaims"])
    at = (("instance", "d0"),)
    assert reclaims[(*at, ("outcome", "acked"), ("service", "decode"))] == 3
    assert reclaims[(*at, ("outcome", "lease"), ("service", "decode"))] == 0   # shown from 0
    assert values(f["pdmesh_decode_anomalies"])[
        (*at, ("rule", "repetition"), ("service", "decode"))] == 4


def test_kv_bytes_and_writes_by_transport_and_the_prefix_cache_by_tier():
    f = families({"prefill": [inst("prefill", "p0", **PREFILL)],
                  "decode": [inst("decode", "d0", **DECODE)],
                  "kvstore": [inst("kvstore", "k0", **KVSTORE)]})
    sent = {dict(k)["transport"]: v for k, v in values(f["pdmesh_prefill_kv_sent_bytes"]).items()}
    writes = {dict(k)["transport"]: v for k, v in values(f["pdmesh_prefill_kv_writes"]).items()}
    assert sent == {"shm": 600, "nats": 400} and writes == {"shm": 3, "nats": 2}
    hits = {(dict(k)["service"], dict(k)["tier"]): v
            for k, v in values(f["pdmesh_prefix_cache_hits_blocks"]).items()}
    assert hits == {("decode", "l1"): 6, ("prefill", "l1"): 1, ("kvstore", "l2"): 5,
                    ("kvstore", "l3"): 2}
    info = values(f["vllm:cache_config_info"])
    assert [dict(k) for k in info] == [{"block_size": "16", "instance": "d0", "model_name": "m",
                                        "num_gpu_blocks": "100", "service": "decode"}]


def test_a_service_that_did_not_answer_has_no_series():
    f = families({"decode": [], "prefill": [], "kvstore": []})
    assert not [n for n in f if n.startswith(("pdmesh_decode_claims", "pdmesh_prefill_jobs"))]
