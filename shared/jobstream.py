"""The job stream's configuration, and keeping the stream at exactly that configuration.

No service may create, change or delete the stream (shared/subjects.py grants them only
STREAM.INFO): a service that could had every other service at its mercy (a `republish`
rule re-published its own messages onto subjects it may not publish to; `sealed: true`
turned prefill/decode disaggregation off for good). The stream is provisioned by the one
identity allowed to, `subjects.ADMIN`, which `pdmesh up` holds (pdmesh/deploy/streamkeeper.py,
on its own loop) and compose runs as the `jobstream` container: it creates the stream,
and every few seconds compares the stream's **whole** configuration with `stream_config`
and puts back anything that differs (a sealed stream, or a change the server will not
undo in place, is deleted and created anew).

    await ensure_stream(js)           # ADMIN: create or repair; returns the replicas
    await wait_stream(js)             # a service: until the stream is there
"""
from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from shared import subjects

log = logging.getLogger("pdmesh.jobstream")

MAX_MSGS = 100_000               # jobs queued at most
MAX_BYTES = 1 << 30              # bytes queued at most (per replica)
MAX_MSG_SIZE = 8 << 20           # one job; equals the servers' max_payload
MAX_AGE_S = 600.0                # a job nobody took in 10 minutes is dropped
CLUSTER_REPLICAS = 3
# what the server reports for a field nobody set: such a field compares equal to absent
_UNSET = (None, False, 0, -1, "", "none", {}, [])


def stream_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(name=subjects.PREFILL_STREAM, subjects=[subjects.prefill_jobs()],
                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                        max_age=MAX_AGE_S, max_msgs=MAX_MSGS, max_bytes=MAX_BYTES,
                        max_msg_size=MAX_MSG_SIZE, discard=DiscardPolicy.NEW,
                        num_replicas=replicas, duplicate_window=120.0)


def clustered(js: JetStreamContext) -> bool:
    """Whether the server this connection is on belongs to a cluster (its INFO says so)."""
    info = getattr(js._nc, "_server_info", None) or {}
    return bool(info.get("cluster"))


def _canonical(cfg: StreamConfig) -> dict[str, Any]:
    """Every field that is set, as the server spells it; the server's own bookkeeping
    (metadata keys `_nats.*`) and the replica count (compared on its own) left out."""
    out = {}
    for k, v in cfg.as_dict().items():
        if isinstance(v, Enum):
            v = v.value
        if k == "metadata":
            v = {mk: mv for mk, mv in (v or {}).items() if not mk.startswith("_nats.")}
        if k != "num_replicas" and not any(v == u and type(v) is type(u) for u in _UNSET):
            out[k] = v
    return out


def drift(have: StreamConfig, want: StreamConfig) -> list[str]:
    """The fields in which have differs from want (sorted); [] when it is what we want."""
    a, b = _canonical(have), _canonical(want)
    out = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if (have.num_replicas or 1) < (want.num_replicas or 1):
        out.append("num_replicas")
    return out


async def stream_drift(js: JetStreamContext) -> list[str]:
    """How the stream as it is differs from stream_config at its own replica count
    (NotFoundError when there is none): the keeper's check and the health check."""
    have = (await js.stream_info(subjects.PREFILL_STREAM)).config
    return drift(have, stream_config(have.num_replicas or 1))


async def ensure_stream(js: JetStreamContext, replicas: int | None = None,
                        wait_s: float = 30.0) -> int:
    """ADMIN only. Create the stream if it is missing, or bring an existing one back to
    stream_config (never to fewer replicas than it has); returns its replicas. replicas
    None: three on a cluster, else one. While JetStream is not ready (no leader yet, a
    cluster gathering its peers, an election after a node died) keep trying for wait_s."""
    want = replicas or (CLUSTER_REPLICAS if clustered(js) else 1)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await _put_stream(js, want)
        except Exception as e:
            if not transient(e) or time.monotonic() > deadline:
                raise
            log.info("job stream not ready (%r); retrying", e)
        await asyncio.sleep(0.5)


async def _put_stream(js: JetStreamContext, want: int) -> int:
    try:
        info = await js.stream_info(subjects.PREFILL_STREAM)
    except NotFoundError:
        await js.add_stream(stream_config(want))
        log.info("job stream created (%d replicas)", want)
        return want
    have = info.config
    r = max(want, have.num_replicas or 1)
    cfg = stream_config(r)
    changed = drift(have, cfg)
    if not changed:
        return r
    log.warning("job stream config drifted in %s: restoring it", ", ".join(changed))
    if not have.sealed:
        try:
            await js.update_stream(cfg)
            if not drift((await js.stream_info(subjects.PREFILL_STREAM)).config, cfg):
                return r
        except APIError as e:
            if transient(e):
                raise
            log.warning("job stream cannot be updated in place (%s)", e.description)
    # sealed (never unsealed), or a change the server refuses to undo: start it afresh
    await js.delete_stream(subjects.PREFILL_STREAM)
    await js.add_stream(cfg)
    log.warning("job stream deleted and created anew")
    return r


async def wait_stream(js: JetStreamContext, wait_s: float = 60.0) -> None:
    """Until the stream exists (ADMIN provisions it); raises after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await js.stream_info(subjects.PREFILL_STREAM)
            return
        except Exception as e:
            if not (isinstance(e, NotFoundError) or transient(e)) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.5)


def transient(e: Exception) -> bool:
    """JetStream not ready or not reachable right now (worth trying again)."""
    if isinstance(e, APIError):
        # unavailable; no resources yet; no suitable peers yet (a cluster still meeting
        # its nodes: an R3 stream created the moment a meta leader answers)
        return e.code == 503 or e.err_code in (10023, 10005)
    return isinstance(e, (nats.errors.TimeoutError, asyncio.TimeoutError,
                          nats.errors.NoRespondersError, NoStreamResponseError,
                          nats.errors.ConnectionReconnectingError))
