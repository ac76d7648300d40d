"""The chunk side of the decode protocol: where a dispatched request's TokenChunks arrive
and how the gateway judges them (dispatch.py is the submission side).

  open(rid)     the request's queue, registered BEFORE its DecodeSubmit goes out (no chunk
                can be missed); close(rid) forgets it (later chunks are counted, dropped)
  on_message    one TokenChunk from NATS into its request's queue; a malformed one that
                names its request fails that request now (rather than at the timeout)
  next(d, ..)   the next chunk, in order: a seq that is not the next one means a chunk was
                lost (Lost, never a silent end); checks the deadline and the client's
                connection on every call and, after each idle tick, the instance
                (heartbeats, its incarnation, probe.py's question, the progress timeouts)
  fail_all      an error chunk to every waiting request (the gateway shuts down)
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from shared.contracts.common import Codec, ContractError, ErrorCode, ErrorReply
from shared.contracts.messages import TokenChunk

from . import probe
from .protocol import OpenAIError
from .registry import Registry

if TYPE_CHECKING:
    from .dispatch import Dispatch

log = logging.getLogger("pdmesh.gateway")

CHUNK = Codec(TokenChunk)


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being served."""


class Lost(OpenAIError):
    """The request's decode instance was lost (the request can be migrated)."""

    def __init__(self, message: str, reason: str):
        super().__init__(503, message, code=ErrorCode.INSTANCE_LOST.value)
        self.reason = reason


class Chunks:
    def __init__(self, nc, registry: Registry, request_timeout_s: float, tick_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, progress_timeout_s: float = 60.0,
                 first_chunk_timeout_s: float = 600.0, probe_after_s: float = 2.0):
        self.nc = nc
        self.registry = registry
        self.request_timeout_s = request_timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.first_chunk_timeout_s = first_chunk_timeout_s
        self.probe_after_s = probe_after_s
        self.tick_s = min(tick_s, registry.dead_after_s / 4)
        self.clock = clock
        self.queues: dict[str, asyncio.Queue] = {}
        self.failing = False        # fail_all ran: a SHUTTING_DOWN chunk is this gateway's
        self.dropped_chunks = 0
        self.bad_messages = 0
        self._reconnects, self._reconnected_at = 0, float("-inf")

    # ---- arrival -------------------------------------------------------------------------
    def open(self, rid: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        return q

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def on_message(self, msg) -> None:
        try:
            chunk = CHUNK.decode(msg.data)
        except ContractError as e:
            self.bad_messages += 1
            log.warning("%s on %s", e, msg.subject)
            chunk = _salvage(msg.data, e)   # fail its request now rather than at the timeout
            if chunk is None:
                return
        q = self.queues.get(chunk.request_id)
        if q is None:
            self.dropped_chunks += 1
            return
        q.put_nowait(chunk)

    def fail_all(self, code: ErrorCode, message: str) -> int:
        """End every waiting request with an error chunk (shutdown after the grace); not
        `finished`, so each is still aborted at its decode instance."""
        self.failing = True         # this gateway shuts down: nothing to migrate to
        for rid, q in self.queues.items():
            q.put_nowait(TokenChunk(request_id=rid, finished=False,
                                    error=ErrorReply(code=code, message=message, request_id=rid)))
        return len(self.queues)

    # ---- reading -------------------------------------------------------------------------
    async def next(self, d: Dispatch, deadline: float,
                         client_gone: Callable[[], bool] | None = None) -> TokenChunk:
        while True:
            now = self.clock()
            if now >= deadline:
                raise OpenAIError(504, f"request did not finish within the gateway's "
                                       f"request_timeout_s ({self.request_timeout_s:g}s)",
                                  code="timeout")
            if client_gone is not None and client_gone():
                raise ClientGone(d.request_id)
            try:
                return self._in_order(d, d.queue.get_nowait())
            except asyncio.QueueEmpty:
                pass
            try:
                c = await asyncio.wait_for(d.queue.get(), min(self.tick_s, deadline - now))
                return self._in_order(d, c)
            except asyncio.TimeoutError:
                pass
            self._check_progress(d)
            if self.nc.is_connected and probe.due(d.probe, d.progress_at, self.clock(),
                                                  self.probe_after_s):
                d.probe = await probe.ask(self.nc, d.instance, d.request_id, self.clock, 1.0)

    def _in_order(self, d: Dispatch, c: TokenChunk) -> TokenChunk:
        """A chunk whose seq is not the next one means one was lost: never a silent end. A
        decode instance that shuts down (drained past its drain_timeout_s: a rolling restart)
        hands its requests on: they migrate like a lost instance's."""
        if (c.error is not None and c.error.code is ErrorCode.SHUTTING_DOWN
                and not self.failing):
            raise Lost(f"decode instance {d.instance} shut down while serving this request",
                       "instance_shutdown")
        if c.error is None:      # (error chunks made here carry no sequence)
            if c.seq != d.next_seq:
                raise Lost(f"decode instance {d.instance}: token chunk {d.next_seq} of this "
                           f"request was lost (got {c.seq})", "chunk_gap")
            d.next_seq += 1
        d.progress_at = self.clock()
        return c

    def blind(self) -> bool:
        """This gateway cannot judge decode liveness now: it is not connected to NATS, or
        reconnected less than dead_after_s ago (heartbeats are only coming back). Silence
        then says nothing about the instances."""
        rc = self.nc.stats.get("reconnects", 0) if hasattr(self.nc, "stats") else 0
        if rc != self._reconnects:
            self._reconnects, self._reconnected_at = rc, self.clock()
        return (not self.nc.is_connected
                or self.clock() - self._reconnected_at < self.registry.dead_after_s)

    def _check_progress(self, d: Dispatch) -> None:
        """Idle for a tick: is the instance still there, and is the request moving?"""
        now = self.clock()
        if self.blind():
            return
        if not self.registry.is_alive(d.instance, now):
            silent = self.registry.silent_for(d.instance, now) or 0.0
            conn = "" if self.nc.is_connected else " (this gateway is not connected to NATS)"
            raise Lost(f"decode instance {d.instance} stopped sending heartbeats "
                       f"({silent:.1f}s silent) while serving this request{conn}", "instance_dead")
        if why := probe.verdict(d.probe, d.progress_at, d.next_seq):
            raise Lost(f"decode instance {d.instance} {why}", "chunks_lost")
        now_serving = self.registry.incarnation(d.instance)
        if d.incarnation and now_serving and now_serving != d.incarnation:
            raise Lost(f"decode instance {d.instance} restarted (a new process) while serving "
                       "this request", "instance_restarted")
        first = d.next_seq == 0        # a prompt's prefill: 8,000 tokens take ~60 s on 2 cores
        limit = self.first_chunk_timeout_s if first else self.progress_timeout_s
        if now - d.progress_at > limit:
            what = "no first token" if first else "nothing"
            raise Lost(f"decode instance {d.instance} sent {what} for this request in "
                       f"{now - d.progress_at:.0f}s ("
                       f"{'first_chunk_timeout_s' if first else 'progress_timeout_s'})",
                       "no_progress")


def _salvage(data: bytes, err: Exception) -> TokenChunk | None:
    """An error chunk for the request a malformed TokenChunk names, if it names one."""
    try:
        rid = msgspec.json.decode(data).get("request_id")
    except (msgspec.DecodeError, AttributeError):
        return None
    if not isinstance(rid, str):
        return None
    return TokenChunk(request_id=rid, finished=False, error=ErrorReply(
        code=ErrorCode.BAD_MESSAGE, message=f"sent a malformed token chunk: {err}", request_id=rid))
