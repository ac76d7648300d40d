"""Every generation-affecting field crosses the decode -> prefill boundary unchanged.

Property-style: random sampling params and constraints (every field set to a random
non-default value, generated from the struct's own field list, so a field added later is
covered automatically — or the generator fails loudly on a type it does not know)
survive DecodeSubmit -> make_prefill_job -> JSON -> PrefillJob.
"""
from __future__ import annotations

import enum
import json
import random
import types
import typing

import msgspec
import pytest

from services.decode.faults import drop_constraint
from services.decode.jobs import CARRIED, make_prefill_job
from shared.contracts.common import Codec, encode
from shared.contracts.constraint import Constraint
from shared.contracts.messages import DecodeSubmit, KvDestination, PrefillJob
from shared.contracts.sampling import SamplingParams


def rand_value(tp, rng: random.Random, name: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return rand_value(args[0], rng, name)
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.randint(1, 10_000)
    if tp is float:
        return round(rng.uniform(0.05, 0.95), 4)
    if tp is str:
        return json.dumps({"k": rng.randint(0, 99)}) if name in ("json_schema", "tools") \
            else f"s{rng.randint(0, 99)}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return rng.choice(list(tp))
    if origin is tuple:
        return tuple(rand_value(typing.get_args(tp)[0], rng, name) for _ in range(rng.randint(1, 3)))
    if origin is list:
        return [rand_value(typing.get_args(tp)[0], rng, name) for _ in range(rng.randint(1, 3))]
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return {rand_value(kt, rng, name): rand_value(vt, rng, name) for _ in range(rng.randint(1, 3))}
    raise TypeError(f"no generator for field {name!r} of type {tp!r}: extend rand_value")


def rand_struct(cls, rng: random.Random):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: (not f.default) if hints[f.name] is bool
                  else rand_value(hints[f.name], rng, f.name)
                  for f in msgspec.structs.fields(cls)})


@pytest.mark.parametrize("seed", range(200))
def test_generation_fields_survive_decode_to_prefill(seed):
    rng = random.Random(seed)
    params, constraint = rand_struct(SamplingParams, rng), rand_struct(Constraint, rng)
    sub = DecodeSubmit(request_id=f"r{seed}", prompt_ids=[rng.randint(0, 999) for _ in range(9)],
                       params=params, constraint=constraint, tokenizer_fingerprint="fp",
                       reply_subject="x")
    dest = KvDestination(instance_id="d", block_ids=[1, 2], epochs=[3, 4])
    job = Codec(PrefillJob).decode(encode(make_prefill_job(sub, dest, "m", 16)))
    for name in CARRIED:
        assert getattr(job, name) == getattr(sub, name), name
    # every field of every sub-struct, individually
    for f in msgspec.structs.fields(SamplingParams):
        assert getattr(job.params, f.name) == getattr(params, f.name), f.name
    for f in msgspec.structs.fields(Constraint):
        assert getattr(job.constraint, f.name) == getattr(constraint, f.name), f.name


def test_every_shared_field_is_carried():
    """A field added to both DecodeSubmit and PrefillJob must be listed in CARRIED
    (and so copied by make_prefill_job and checked above)."""
    sub = {f.name for f in msgspec.structs.fields(DecodeSubmit)}
    job = {f.name for f in msgspec.structs.fields(PrefillJob)}
    assert (sub & job) - {"v"} == set(CARRIED)


def test_random_params_set_every_field_away_from_its_default():
    rng = random.Random(0)
    p = rand_struct(SamplingParams, rng)
    for f in msgspec.structs.fields(SamplingParams):
        assert getattr(p, f.name) != f.default, f.name


def test_fault_switch_really_drops_the_constraint():
    rng = random.Random(1)
    sub = DecodeSubmit(request_id="r", prompt_ids=[1], params=SamplingParams(),
                       constraint=rand_struct(Constraint, rng), tokenizer_fingerprint="fp",
                       reply_subject="x")
    dest = KvDestination(instance_id="d", block_ids=[1], epochs=[1])
    job = make_prefill_job(sub, dest, "m", 16)
    assert job.constraint != Constraint()
    assert drop_constraint(job).constraint == Constraint()
