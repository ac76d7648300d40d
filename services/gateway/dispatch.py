"""The gateway's side of the decode protocol, over NATS.

Life cycle of a request:
  submit      resolve the seed (so placement never changes output), pick the least loaded
              live decode instance (registry, fed by heartbeats), register the request's
              TokenChunk queue BEFORE sending DecodeSubmit (no chunk can be missed), wait for
              SubmitAck. OVERLOADED / SHUTTING_DOWN / TOKENIZER_MISMATCH / no responders /
              no answer -> the next instance, under a fresh request id (a late acceptance by
              the first cannot leak chunks into this request; it is told to abort).
              INVALID_REQUEST -> 400; any other refusal -> 502; nobody left -> 503.
  next_chunk  the next TokenChunk, in order, the instance watched meanwhile (chunks.py:
              where chunks arrive and how they are judged).
  abort       Abort(request_id, reason) to the instance (client gone, timeout, shutdown).
  release     forget the queue; later chunks for the id are counted and dropped.
  redispatch  after decode aborted the request for an acceptance anomaly (invariant 5):
              the same submission (prompt, params with the resolved seed, constraint) to
              an instance that has not had it, at most max_redispatch times per request.
  migrate     after the request's instance was lost (invariant 7): next_chunk raises Lost
              when the instance stops heartbeating, when a chunk's seq is not the next one
              (a chunk was lost: never taken for the end), or when no chunk came for
              progress_timeout_s (first_chunk_timeout_s before the first: a prompt's
              prefill), or sooner when the instance says it sent more than arrived
              (probe.py). It moves to another instance as prompt + the tokens received so
              far (resume_from: decode's grammar replays them; the sampler's stream is
              keyed by position, so a seeded stream continues as one generation), with
              max_tokens/min_tokens reduced by what was received; at most max_migrations
              times, then the Lost error reaches the client.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors

from shared import subjects, tracing
from shared.contracts.common import Codec, ContractError, ErrorCode, encode
from shared.contracts.constraint import Constraint
from shared.contracts.messages import Abort, DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk
from shared.contracts.sampling import SamplingParams
from shared.service import ServiceError, decode_reply

from . import probe
from .affinity import PrefixAffinity
from .chunks import Chunks
from .limits import check_fits
from .protocol import OpenAIError, overloaded
from .registry import Registry

log = logging.getLogger("pdmesh.gateway")

ACK = Codec(SubmitAck)
HEARTBEAT = Codec(Heartbeat)

# ABORTED at admission: decode dropped the request before acknowledging it (its orphan sweep
# took this gateway for gone while a loaded host delayed its heartbeat), not the client's doing
RETRY_ELSEWHERE = {ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN, ErrorCode.TOKENIZER_MISMATCH,
                   ErrorCode.ABORTED}


@dataclass(slots=True)
class Submission:
    """What decode is asked to serve, kept for a re-dispatch."""
    request_id: str
    prompt_ids: list[int] = field(repr=False)
    params: SamplingParams     # seed resolved: every instance produces the same tokens
    constraint: Constraint
    force_path: Path | None
    tried: set[str] = field(default_factory=set)   # instances it was sent to
    resume_from: int = 0       # migration: trailing prompt tokens that are output so far
    cache_salt: str = ""       # the tenant's prefix-cache salt (auth.cache_salt)
    prefer: str | None = None  # tried first if alive (n > 1: choice 0's instance, choices.py)
    seeded: bool = False       # the client chose the seed: the same tokens wherever it runs


@dataclass(slots=True)
class Dispatch:
    """One request accepted by one decode instance."""
    request_id: str
    instance: str
    path: Path
    queue: asyncio.Queue = field(repr=False)
    sub: Submission = field(repr=False)
    finished: bool = False     # decode has ended it (no abort needed)
    redispatches: int = 0      # earlier dispatches of the request that decode aborted
    migrations: int = 0        # earlier dispatches whose instance was lost
    origin: Submission | None = field(default=None, repr=False)   # before any migration
    next_seq: int = 0          # the seq the next TokenChunk must carry
    progress_at: float = 0.0   # when the last chunk (or the dispatch) arrived
    incarnation: str = ""      # the decode process that accepted it
    probe: probe.Probe | None = None   # the last question to the instance (probe.py)
    counted_on: int | None = None      # the heartbeat its load counts on (Registry.sent)


class DecodeClient:
    def __init__(self, nc, registry: Registry, instance_id: str, fingerprint: str,
                 submit_timeout_s: float, request_timeout_s: float, tick_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, max_redispatch: int = 2,
                 max_migrations: int = 3, progress_timeout_s: float = 60.0,
                 first_chunk_timeout_s: float = 600.0, probe_after_s: float = 2.0):
        self.nc = nc
        self.registry = registry
        self.instance_id = instance_id
        self.reply_subject = subjects.gateway_tokens(instance_id)
        self.fingerprint = fingerprint
        self.submit_timeout_s = submit_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_redispatch = max_redispatch
        self.max_migrations = max_migrations
        self.clock = clock
        self.chunks = Chunks(nc, registry, request_timeout_s, tick_s, clock, progress_timeout_s,
                             first_chunk_timeout_s, probe_after_s)
        self.bad_messages = 0      # malformed heartbeats (chunks.bad_messages: chunks)
        self.affinity = PrefixAffinity()
        self.routed_warm = 0       # requests sent where their prefix was likely cached
        self._rng = random.Random()

    async def start(self) -> None:
        await self.nc.subscribe(subjects.heartbeats_all(), cb=self._on_heartbeat)
        await self.nc.subscribe(self.reply_subject, cb=self.chunks.on_message)

    @property
    def queues(self) -> dict[str, asyncio.Queue]:
        """Requests waiting for chunks, by request id."""
        return self.chunks.queues

    async def next_chunk(self, d: Dispatch, deadline: float,
                         client_gone: Callable[[], bool] | None = None) -> TokenChunk:
        return await self.chunks.next(d, deadline, client_gone)

    def fail_all(self, code: ErrorCode, message: str) -> int:
        return self.chunks.fail_all(code, message)

    # ---- inbound -----------------------------------------------------------------------
    async def _on_heartbeat(self, msg) -> None:
        try:
            self.registry.observe(HEARTBEAT.decode(msg.data), self.clock())
        except ContractError as e:
            self.bad_messages += 1
            log.warning("%s on %s", e, msg.subject)

    # ---- submit ------------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     constraint: Constraint, force_path: str | None = None,
                     cache_salt: str = "", prefer: str | None = None) -> Dispatch:
        seeded = params.seed is not None
        if not seeded:
            params = msgspec.structs.replace(params, seed=self._rng.getrandbits(63))
        return await self.send(Submission(request_id, prompt_ids, params, constraint,
                                           Path(force_path) if force_path else None,
                                           cache_salt=cache_salt, prefer=prefer,
                                           seeded=seeded))

    async def redispatch(self, d: Dispatch, fresh_sample: bool = False) -> Dispatch | None:
        """d was aborted for an acceptance anomaly: the same submission to an instance
        that has not had it. fresh_sample (a repetition loop: the output, not the
        instance, went wrong): a new seed, on any instance; None for a greedy or
        client-seeded request, which would loop again. None too when d's request was
        already re-dispatched max_redispatch times, or no instance takes it (the caller
        then reports the anomaly)."""
        if d.redispatches >= self.max_redispatch:
            return None
        sub = d.sub
        if fresh_sample:
            if sub.params.greedy or sub.seeded:
                return None
            sub = dataclasses.replace(
                sub, request_id=f"{sub.request_id}.r{d.redispatches + 1}", tried=set(),
                params=msgspec.structs.replace(sub.params, seed=self._rng.getrandbits(63)))
        try:
            nd = await self.send(sub)
        except OpenAIError as e:
            log.warning("%s: re-dispatch failed: %s", d.sub.request_id, e.message)
            return None
        nd.redispatches, nd.migrations, nd.origin = d.redispatches + 1, d.migrations, d.origin
        return nd

    async def send(self, sub: Submission) -> Dispatch:
        """To the best instance not yet tried; refusals that another may not share move
        on to the next (under a fresh request id)."""
        tried = sub.tried
        reasons: list[str] = []
        cached = self.affinity.best(sub.prompt_ids, sub.cache_salt)
        await self._until_sighted(tried)
        while (inst := self.registry.choose(self.clock(), tried, cached,
                                            prefer=sub.prefer)) is not None:
            rid = sub.request_id if not tried else f"{sub.request_id}.{len(tried)}"
            tried.add(inst)
            queue = self.chunks.open(rid)
            beat = self.registry.sent(inst)   # now: a burst of submissions spreads out
            try:
                ack = await self._submit(inst, rid, sub)
            except BaseException:
                self.registry.sent(inst, -1)
                self.chunks.close(rid)     # whatever went wrong, nothing stays behind
                raise
            if isinstance(ack, str):
                self.registry.sent(inst, -1)
                reasons.append(ack)
                continue
            self.routed_warm += cached.get(inst, 0) > 0
            self.affinity.record(sub.prompt_ids, inst, sub.cache_salt)
            return Dispatch(rid, inst, ack.path, queue, sub, progress_at=self.clock(),
                            incarnation=ack.incarnation, counted_on=beat)
        if reasons and all(ErrorCode.OVERLOADED.value in r for r in reasons):
            raise overloaded("every decode instance refused: " + "; ".join(reasons))
        why = self.registry.why_none(self.clock(), tried)
        if not self.nc.is_connected:
            why += " (this gateway is not connected to NATS)"
        if reasons:
            why += ": " + "; ".join(reasons)
        raise OpenAIError(503, why, code="no_decode_instance")

    async def _until_sighted(self, tried: set[str]) -> None:
        """While blind with no live instance to choose, wait (up to submit_timeout_s) for
        the heartbeats to come back rather than refuse at once."""
        deadline = self.clock() + self.submit_timeout_s
        while (self.chunks.blind() and self.registry.choose(self.clock(), tried) is None
               and self.clock() < deadline):
            await asyncio.sleep(0.1)

    async def _submit(self, inst: str, rid: str, sub: Submission) -> SubmitAck | str:
        """DecodeSubmit to one instance: its acknowledgement, or why to try another one
        (its chunk queue is dropped then); raises what another instance would not change."""
        msg = DecodeSubmit(request_id=rid, prompt_ids=sub.prompt_ids, params=sub.params,
                           constraint=sub.constraint, tokenizer_fingerprint=self.fingerprint,
                           reply_subject=self.reply_subject, force_path=sub.force_path,
                           gateway=self.instance_id, resume_from=sub.resume_from,
                           cache_salt=sub.cache_salt)
        data = encode(msg)
        check_fits(len(data), getattr(self.nc, "max_payload", 0))
        try:
            with tracing.span("submit", kind="CLIENT", request_id=rid, decode=inst):
                reply = await self.nc.request(subjects.decode_submit(inst), data,
                                              timeout=self.submit_timeout_s)
            return decode_reply(reply.data, reply.headers, ACK)
        except ServiceError as e:
            self.chunks.close(rid)
            err = e.reply
            if err.code in RETRY_ELSEWHERE:
                return f"{inst}: {err.code.value} ({err.message})"
            if err.code == ErrorCode.INVALID_REQUEST:
                raise OpenAIError(400, err.message, code=err.code.value) from None
            raise OpenAIError(502, f"decode instance {inst} refused the request: "
                                   f"{err.code.value}: {err.message}",
                              code=err.code.value) from None
        except nats.errors.NoRespondersError:
            self.chunks.close(rid)
            return f"{inst}: not listening"
        except asyncio.CancelledError:     # the client left while decode was accepting
            self.chunks.close(rid)
            await self._abort(inst, rid, "client")          # in case it did accept
            raise
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            self.chunks.close(rid)
            await self._abort(inst, rid, "unacknowledged")   # in case it did accept
            return f"{inst}: no answer within {self.submit_timeout_s:g}s"
        except ContractError as e:
            self.chunks.close(rid)
            await self._abort(inst, rid, "bad_ack")
            raise OpenAIError(502, f"decode instance {inst} sent a malformed "
                                   f"acknowledgement: {e}", code="bad_message") from None
        except nats.errors.Error as e:   # connection closed / draining / reconnecting
            self.chunks.close(rid)
            return f"{inst}: {type(e).__name__}: {e}"

    async def abort(self, d: Dispatch, reason: str) -> None:
        if not d.finished:
            d.finished = True
            await self._abort(d.instance, d.request_id, reason)

    def release(self, d: Dispatch) -> None:
        self.chunks.close(d.request_id)
        self.registry.ended(d.instance, d.counted_on)
        d.counted_on = None                # once

    async def _abort(self, instance: str, request_id: str, reason: str) -> None:
        try:
            await self.nc.publish(subjects.decode_abort(instance),
                                  encode(Abort(request_id=request_id, reason=reason)))
        except Exception as e:  # noqa: BLE001 - best effort; decode also times requests out
            log.warning("abort of %s on %s failed: %s", request_id, instance, e)
