"""Contracts: typed decoders refuse wrong shapes with a ContractError; KV headers survive
a round trip; subjects obey the naming rules."""
from __future__ import annotations

import re

import msgspec
import pytest

from shared import subjects
from shared.contracts.common import Codec, ContractError, encode
from shared.contracts.kv import KvWrite
from shared.contracts.messages import Abort, DecodeSubmit, KvDestination, PrefillJob
from shared.contracts.reclaim import ClaimReply, PrefillClaim, Reclaim, ReclaimAck
from shared.contracts.sampling import SamplingParams


def test_typed_decoder_rejects_wrong_types():
    codec = Codec(DecodeSubmit)
    for bad in (b"", b"{}", b"[]", b'{"request_id": 1}', b"\xff\xfe",
                b'{"request_id":"a","prompt_ids":"x","params":{},"tokenizer_fingerprint":"f","reply_subject":"s"}'):
        with pytest.raises(ContractError):
            codec.decode(bad)


def test_prefill_job_roundtrip_keeps_every_field():
    job = PrefillJob(request_id="r", prompt_ids=[1, 2], tokenizer_fingerprint="fp", model="m",
                     block_size=16,
                     params=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                                           presence_penalty=0.5, frequency_penalty=-0.5,
                                           repetition_penalty=1.1, logit_bias={5: -3.0},
                                           seed=42, max_tokens=9, min_tokens=2, stop=("x",),
                                           stop_token_ids=(3,), ignore_eos=True, logprobs=2),
                     dest=KvDestination(instance_id="d", block_ids=[4, 5], epochs=[7, 8]))
    assert Codec(PrefillJob).decode(encode(job)) == job


def test_kv_write_headers_roundtrip():
    w = KvWrite(request_id="r", epochs=[1, 2], block_ids=[3, 4], layer_start=0, layer_end=6,
                dtype="bfloat16", shape=[6, 2, 2, 16, 2, 32], seq=0, sender="p", digest="ab" * 16)
    h = w.headers()
    assert all(isinstance(v, str) for v in h.values())
    assert KvWrite.from_headers(h) == w
    w2 = msgspec.structs.replace(w, attempt="a1b2")
    assert KvWrite.from_headers(w2.headers()) == w2
    with pytest.raises(ContractError, match="older pdmesh"):    # a mesh mid-upgrade
        KvWrite.from_headers({"Pdmesh-request_id": "r", "Pdmesh-seq": "0", "Pdmesh-v": "1"})
    for bad in (None, {}, {"Pdmesh-write": "{"}, {"Pdmesh-write": '{"request_id": 5}'},
                {"Pdmesh-v": "1"}):
        with pytest.raises(ContractError):
            KvWrite.from_headers(bad)


def test_subjects_follow_the_rules():
    made = [subjects.decode_submit("d_1"), subjects.decode_abort("d_1"), subjects.decode_kv("d_1"),
            subjects.decode_prefill_done("d_1"), subjects.decode_claim("d_1"),
            subjects.prefill_jobs(),
            subjects.prefill_reclaim("p_1"), subjects.gateway_tokens("g_1"),
            subjects.kvstore_health(), subjects.kvstore_lookup(), subjects.kvstore_fetch(),
            subjects.kvstore_layer("k_1"), subjects.kvstore_put(), subjects.heartbeat("decode"),
            subjects.request_event("aborted"), subjects.health("decode", "d_1")]
    for s in made:
        assert re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+){1,4}", s), s
    with pytest.raises(ValueError):
        subjects.decode_submit("Bad.Id")
    assert subjects.instance_token("Decode-host.1") == "decode_host_1"


def test_messages_are_json_for_nats_sub():
    sp = SamplingParams(seed=1)
    assert msgspec.json.decode(encode(sp)) == {"seed": 1}


def test_reclaim_messages_roundtrip():
    for m in (PrefillClaim(request_id="r", attempt="a", prefill_instance="p", block_ids=[1],
                           epochs=[9]),
              ClaimReply(request_id="r", granted=False, reason="unknown request"),
              Reclaim(request_id="r", attempt="a", decode_instance="d", reason="client"),
              ReclaimAck(request_id="r", attempt="a", prefill_instance="p", owner=True,
                         writes_issued=3, writes_completed=2, writes_failed=1)):
        assert Codec(type(m)).decode(encode(m)) == m
    with pytest.raises(ContractError):
        Codec(ReclaimAck).decode(b'{"request_id": "r"}')


def test_no_message_parses_as_another():
    """Issue 29: decoders were lenient, so one message parsed as another (decode's
    ClaimReply, aimed at its own abort subject, read as an Abort and aborted another
    tenant's request). Every contract carries its type; a decoder refuses any other type,
    and still takes a message without one (from a pdmesh before the tags)."""
    import inspect

    from shared.contracts import common, kv, kvcache, messages, reclaim

    structs = [v for m in (common, kv, kvcache, messages, reclaim) for v in vars(m).values()
               if inspect.isclass(v) and issubclass(v, msgspec.Struct)
               and v.__module__ == m.__name__]     # defined there; not the value types
    #                                          (SamplingParams, Constraint: inside messages)
    assert len(structs) >= 20
    assert all(s.__struct_config__.tag == s.__name__ for s in structs), \
        [s.__name__ for s in structs if s.__struct_config__.tag != s.__name__]
    reply = encode(ClaimReply(request_id="r-of-another-tenant", granted=True))
    with pytest.raises(ContractError, match="type"):
        Codec(Abort).decode(reply)
    old = b'{"request_id": "r", "reason": "client"}'             # untagged, as before
    assert Codec(Abort).decode(old).request_id == "r"
