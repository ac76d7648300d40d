"""Whole-mesh fixtures: real nats-server, real services as processes, real HTTP."""
from __future__ import annotations

import os

import pytest

from pdmesh.local.cluster import Cluster

# Prefill and decode must share every shape-affecting engine setting for the
# deterministic (batch-invariant) comparisons: these go to both.
DET = dict(deterministic=True, dtype="float32", threads=1)
ENGINE_SHAPES = {"max_num_batched_tokens": 128, "chunk_size": 32, "block_size": 16}


def det_overrides(**decode) -> dict:
    return {"decode": ENGINE_SHAPES | {"max_num_seqs": 16} | decode,
            "prefill": ENGINE_SHAPES | {"ack_wait_s": 3.0}}


@pytest.fixture(scope="session")
def mesh(tiny_target):
    """One prefill, one decode, deterministic mode, tiny model: one for the whole session,
    shared by every module that only sends it requests (a module that changes a mesh, or
    needs other settings, starts its own)."""
    # PDMESH_FAULT_DROP_CONSTRAINT=1 (manual runs only) shows the constraint tests failing
    faults = {"fault_drop_constraint_in_job": True} if os.environ.get(
        "PDMESH_FAULT_DROP_CONSTRAINT") else {}
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=det_overrides(**faults),
                 echo=False) as c:
        yield c


def reference_engine(model, **kw):
    """The engine alone, configured exactly like the mesh's decode."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    cfg = dict(model=str(model), dtype="float32", deterministic=True, threads=1,
               max_num_seqs=16, num_blocks=512, **ENGINE_SHAPES)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))
