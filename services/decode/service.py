"""Decode service: the NATS face of decode's KV slots and continuous batch.

Life cycle of a request (the record and its states: request.py; the table: lifecycle.py):
  on_submit (from the gateway) -> check fingerprint and limits -> choose the path:
    colocated: the engine prefills and decodes the prompt itself;
    pd: reserve KV blocks, each stamped with an epoch (slots.py) -> PrefillJob on the
        JetStream work queue (the ack waits for it briefly: queueing.py) -> on_claim: the
        prefill attempt that pulls it claims the blocks (granted only while the request
        awaits KV) -> on_kv_write: KV writes land in the reserved blocks (epoch-fenced)
        -> on_prefill_done (first token, writes issued) -> join the continuous batch.
  -> every engine step streams TokenChunks to the gateway (stream.py) -> finished or
  aborted; aborts, fallbacks and reclaims: reclaim.py. Test-only faults wrap the slots,
  the peers and on_submit (inject.py); nothing here branches on them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

from shared import subjects, tracing
from shared.contracts.common import Codec, ContractError, ErrorCode, Ok, encode
from shared.contracts.messages import (
    Abort,
    AbortReason,
    DecodeSubmit,
    Heartbeat,
    KvDestination,
    Path,
    PrefillDone,
    PrefillStatus,
    ProgressQuery,
    ProgressReply,
    SubmitAck,
)
from shared.contracts.reclaim import ClaimReply, PrefillClaim
from shared.engine.block_pool import NoFreeBlocks
from shared.engine.engine import LLMEngine
from shared.engine.grammar import ReplayError
from shared.engine_loop import run_engine_loop
from shared.faults import require_allowed
from shared.jobstream import wait_stream
from shared.kv.nats_transport import NatsKvTransport
from shared.kv.shm import host_id
from shared.kv.writeback import WriteBack
from shared.kvstore_client import KvstoreClient
from shared.precompile import precompile
from shared.service import ServiceError, ServiceRuntime, new_instance_id

from . import inject
from .config import DecodeConfig
from .jobs import make_prefill_job
from .kvwrites import KvWrites
from .lifecycle import Next, RequestTable
from .monitor import RULES, AnomalyMonitor
from .orphans import GatewayWatch
from .peers import DecodePeers, NatsDecodePeers
from .queueing import JobQueueing
from .reclaim import Reclaimer
from .slots import KvSlots, Slots
from .stream import TokenStream

log = logging.getLogger("pdmesh.decode")
HEARTBEAT = Codec(Heartbeat)


class DecodeService:
    def __init__(self, cfg: DecodeConfig, engine: LLMEngine | None = None,
                 peers: DecodePeers | None = None):
        require_allowed(cfg.faults)
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("decode")
        self.incarnation = secrets.token_hex(8)    # this process: a restart is a new one
        self.engine = engine or LLMEngine(cfg.engine)
        self.fingerprint = self.engine.tokenizer.fingerprint
        self.rt = ServiceRuntime("decode", self.iid, cfg.nats_url, stats=self.stats,
                                 auth=cfg.nats)
        self.peers, self.kvc = None, None
        self.table = RequestTable(cfg.reclaim_lease_s, cfg.reclaim_timeout_s)
        self.slots = KvSlots(self.engine)
        self.prefill_seen: dict[str, float] = {}
        self.gateways = GatewayWatch(cfg.gateway_dead_after_s)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.queueing = JobQueueing()    # jobs still being queued after their ack
        self.wake = asyncio.Event()
        self.accepting = True
        # submissions in hand (handled concurrently) -> an abort that came meanwhile
        self.admitting: dict[str, AbortReason | None] = {}
        self.counters = {"pd": 0, "colocated": 0, "kv_writes_applied": 0, "kv_writes_fenced": 0,
                         "kv_bytes": 0}
        # the repetition rule always; the acceptance rules while speculating
        self.monitor = AnomalyMonitor(cfg.monitor_config()) if cfg.monitor else None
        self.injected = inject.install(self, cfg.faults)   # TEST ONLY wrappers, if any
        self.reclaimer = Reclaimer(self.iid, self.table, self.slots, None, self.rt.spawn,
                                   cfg.reclaim_timeout_s, self._forget, self.wake.set)
        self.stream = TokenStream(self.iid, self.table, None, self.reclaimer, self.monitor,
                                  self.write_back)
        self.writeback = None
        self.kv_rx: NatsKvTransport | None = None    # KV writes in (start())
        kv_writes = KvWrites(self)
        self.admits, self.on_kv_write = kv_writes.admits, kv_writes.on_write
        self.spans = tracing.Spans("decode")     # await_kv, generate: per request (if on)
        if peers is not None:
            self.connect(peers)

    def connect(self, peers: DecodePeers) -> None:
        """Where decode's messages go (NATS from start(); in memory in tests)."""
        peers = inject.wrap_peers(peers, self.cfg.faults)
        self.peers = self.reclaimer.peers = self.stream.peers = peers

    def _forget(self, rid: str) -> None:
        self.spans.end_all(rid)
        if self.monitor is not None:
            self.monitor.forget(rid)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.rt.start()
        nc = self.rt.nc
        js = nc.jetstream()
        await wait_stream(js)                    # the admin provisions it
        self.connect(NatsDecodePeers(nc, js))
        self.kvc = KvstoreClient(nc, self.cfg.kvstore_timeout_s)
        await self.kvc.follow_heartbeats()
        if self.cfg.kvstore:
            self.writeback = WriteBack(self.cfg.write_policy, self.kvc)
        ep = self.rt.endpoint
        # each submission in a task of its own: one waiting on its cache lookup or on the
        # job queue must not hold back the rest (a burst's waits added up past the
        # gateway's submit_timeout_s: tests/e2e/test_up_faults.py, a frozen kvstore)
        await ep("submit", subjects.decode_submit(self.iid), self.on_submit, Codec(DecodeSubmit),
                 concurrent=True)
        await ep("abort", subjects.decode_abort(self.iid), self.on_abort, Codec(Abort))
        await ep("progress", subjects.decode_progress(self.iid), self.on_progress,
                 Codec(ProgressQuery))
        await ep("prefill_done", subjects.decode_prefill_done(self.iid), self.on_prefill_done,
                 Codec(PrefillDone))
        await ep("claim", subjects.decode_claim(self.iid), self.on_claim, Codec(PrefillClaim))
        self.kv_rx = NatsKvTransport(self.rt)
        await self.kv_rx.listen(self.iid, self.on_kv_write, self.admits)
        await nc.subscribe(subjects.heartbeat("prefill"), cb=self.on_heartbeat)
        await nc.subscribe(subjects.heartbeat("gateway"), cb=self.on_heartbeat)
        self.rt.spawn(self.engine_loop())
        self.rt.spawn(self.reclaimer.run(self.cfg.prefill_timeout_s))
        self.rt.spawn(self.abort_orphans())
        log.info("decode %s ready (model %s, %d KV blocks)", self.iid, self.cfg.model,
                 self.engine.port.num_blocks)

    async def serve(self) -> None:
        await self.start()
        await self.rt.run(heartbeat=self.heartbeat, drain=self.drain)
        await self.rt.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let running requests finish, abort the rest, and give
        their reclaims a moment (so prefill stops writing for requests that are gone)."""
        self.accepting = False
        deadline = time.monotonic() + self.cfg.kvstore_timeout_s + self.cfg.job_queue_wait_s + 1
        while self.admitting and time.monotonic() < deadline:   # in hand: drained as the rest
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while any(True for _ in self.table.live()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for r in list(self.table.live()):
            await self.stream.fail(r.request_id, ErrorCode.SHUTTING_DOWN,
                                   "decode instance shut down", AbortReason.SHUTDOWN)
        deadline = time.monotonic() + min(self.cfg.reclaim_lease_s, 3 * self.cfg.reclaim_timeout_s)
        while any(True for _ in self.table.quarantined()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats() | self.table.stats()
        return Heartbeat(service="decode", instance_id=self.iid, model=self.cfg.model,
                         tokenizer_fingerprint=self.fingerprint, running=st["running"],
                         waiting=st["waiting"], queue_depth=st["awaiting_kv"],
                         blocks_free=st["blocks_free"], blocks_used=st["blocks_used"],
                         blocks_quarantined=st["blocks_quarantined"],
                         accepting=self.accepting, max_model_len=self.engine.max_model_len,
                         capacity=self.engine.cfg.max_num_seqs, ready=self.ready(),
                         host=host_id(), ts=time.time(), incarnation=self.incarnation)

    def write_back(self, rid: str) -> None:
        """A prompt computed here goes to kvstore too: its prefix then hits on either path
        (prefill loads it from there)."""
        if self.writeback is not None:
            self.writeback(self.engine, *self.engine.port.computed_prompt_blocks(rid))

    def ready(self) -> bool:
        """Every path usable: accepting, and a live prefill worker if PD is expected."""
        return self.accepting and (not self.cfg.require_prefill or self.cfg.mode == "colocated"
                                   or self.prefill_alive())

    def prefill_alive(self) -> bool:
        return any(time.monotonic() - t < self.cfg.prefill_dead_after_s
                   for t in self.prefill_seen.values())

    def stats(self) -> dict:
        kvc = self.kvc.counters if self.kvc is not None else {}
        counts = self.monitor.counts if self.monitor is not None else {}
        anomalies = {f"anomaly_{rule}": counts.get(rule, 0) for rule in RULES}
        table = self.table.stats()
        return (self.engine.stats() | {"requests": table["requests_live"]} | self.counters
                | {"prefill_fallbacks": self.reclaimer.fallbacks} | table | kvc | anomalies
                | {f"fault_{k}_injected": n for k, n in self.injected.items()})

    # ---- handlers ---------------------------------------------------------------------
    async def on_submit(self, sub: DecodeSubmit) -> bytes:
        rid = sub.request_id
        self._check_submit(sub)
        self.admitting[rid] = None
        try:
            ack = await self._admit(sub)
        finally:
            aborted = self.admitting.pop(rid, None)
        if aborted is not None:   # (the gateway gave up waiting for this ack: its abort)
            self.reclaimer.abort(rid, aborted)
            raise ServiceError(ErrorCode.ABORTED, "aborted while being admitted", rid)
        return ack

    async def _admit(self, sub: DecodeSubmit) -> bytes:
        rid = sub.request_id
        fields = {"reply_subject": sub.reply_subject, "gateway": sub.gateway,
                  "submitted": time.monotonic()}
        slots = None
        try:
            self.engine.check_request(sub.prompt_ids, sub.params)
            await precompile(self.engine, sub.constraint)   # off the loop (the engine's owner)
            if self.choose_path(sub) is Path.PD:
                slots = await self._reserve(sub)
                self.table.admit_remote(rid, slots.dest, slots.epochs, slots.held,
                                        path=Path.PD, **fields)
            else:
                self._admit_local(sub, fields)
        except NoFreeBlocks:          # queue locally rather than refuse
            self._admit_local(sub, fields)
        except ValueError as e:       # limits, ids, an uncompilable constraint
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), rid) from e
        if slots is not None:
            await self.queueing.within(rid, self._dispatch(sub, slots),
                                       self.cfg.job_queue_wait_s)
        r = self.table.get(rid)
        path = r.path if r is not None else self.table.recently_finished.get(rid)
        if path is None:      # aborted while its job was being queued: it is gone already
            raise ServiceError(ErrorCode.ABORTED, "aborted while being admitted", rid)
        # (finished already, its chunks sent: a fast prefill and max_tokens 1)
        self.counters[path.value] += 1
        self.wake.set()
        return encode(SubmitAck(request_id=rid, path=path, incarnation=self.incarnation))

    def _check_submit(self, sub: DecodeSubmit) -> None:
        if not self.accepting:
            raise ServiceError(ErrorCode.SHUTTING_DOWN, "decode is draining", sub.request_id)
        if sub.tokenizer_fingerprint != self.fingerprint:
            raise ServiceError(ErrorCode.TOKENIZER_MISMATCH,
                               "tokenizer fingerprint differs from this decode instance's",
                               sub.request_id)
        if self.table.get(sub.request_id) is not None or sub.request_id in self.admitting:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "duplicate request id", sub.request_id)
        queued = self.engine.port.busy()[1] + self.table.awaiting_kv() + len(self.admitting)
        if queued >= self.cfg.max_queued:
            raise ServiceError(ErrorCode.OVERLOADED, f"{queued} requests queued here "
                               f"(max_queued {self.cfg.max_queued})", sub.request_id)

    def _admit_local(self, sub: DecodeSubmit, fields: dict) -> None:
        self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params,
                                constraint=sub.constraint, replay=sub.resume_from,
                                cache_salt=sub.cache_salt)
        self.table.admit_local(sub.request_id, path=Path.COLOCATED, **fields)
        self.spans.start(sub.request_id, "generate", path="colocated")

    async def _reserve(self, sub: DecodeSubmit) -> Slots:
        tier, asked = 0, self.cfg.kvstore and self.kvc is not None
        if asked:   # once per request: the job tells prefill (PrefillJob.kvstore_blocks)
            tier = await self.kvc.lookup(self.engine.prefix_keys(sub.prompt_ids, sub.cache_salt))
        with tracing.span("reserve", kvstore_blocks=tier):
            slots = self.slots.reserve(sub.request_id, sub.prompt_ids, sub.params, sub.constraint,
                                       tier, self.table.awaiting_kv(), sub.resume_from,
                                       sub.cache_salt)
            if slots.load is not None:
                self.rt.spawn(self.kvc.load(self.engine, slots.load))
        return dataclasses.replace(slots, kvstore_blocks=tier if asked else None)

    async def _dispatch(self, sub: DecodeSubmit, slots: Slots) -> None:
        dest = KvDestination(instance_id=self.iid, block_ids=slots.dest, epochs=slots.epochs,
                             skip_blocks=slots.skip)
        job = make_prefill_job(sub, dest, self.cfg.model, self.engine.cfg.block_size,
                               slots.kvstore_blocks)
        self.spans.start(sub.request_id, "await_kv", blocks=len(slots.dest))
        try:
            await self.peers.queue_job(job)
            self.table.queued(sub.request_id)
        except Exception as e:  # noqa: BLE001 - fall back, never fail
            log.info("%s: PD dispatch failed (%s); prefilling locally", sub.request_id, e)
            r = self.table.get(sub.request_id)
            if r is not None and r.wants_kv:
                self.reclaimer.fallback(sub.request_id, AbortReason.DISPATCH_FAILED)

    def choose_path(self, sub: DecodeSubmit) -> Path:
        if sub.force_path is not None:
            return sub.force_path
        if self.cfg.mode != "auto":
            return Path(self.cfg.mode)
        uncached = len(sub.prompt_ids) - self.engine.cached_prefix_tokens(sub.prompt_ids,
                                                                          sub.cache_salt)
        pd = self.prefill_alive() and uncached >= self.cfg.min_pd_prompt_tokens
        return Path.PD if pd else Path.COLOCATED

    async def on_claim(self, c: PrefillClaim) -> bytes:
        granted, why = self.table.claim(c.request_id, c.attempt, c.prefill_instance,
                                        c.block_ids, c.epochs)
        r = self.table.get(c.request_id)
        if granted and r is not None and not r.began:
            r.began = time.monotonic()          # its prompt's queue time ends (phases())
        return encode(ClaimReply(request_id=c.request_id, granted=granted, reason=why))

    async def on_prefill_done(self, done: PrefillDone) -> bytes:
        """An attempt has stopped writing (its PrefillDone, on its own or in its write)."""
        rid, attempt = done.request_id, done.attempt or done.prefill_instance
        nxt = self.table.prefill_done(rid, attempt, done.status is PrefillStatus.OK,
                                      done.writes_issued)
        self.reclaimer.release_if_settled(rid)
        if nxt is Next.FALLBACK:
            log.warning("%s: prefill %s (%s, %d/%d writes); prefilling locally", rid,
                        done.status.value, done.error.message if done.error else "",
                        self.table.writes_received(rid, attempt), done.writes_issued)
            self.reclaimer.fallback(rid, AbortReason.PREFILL_FAILED)
        elif nxt is Next.START:
            await self._start(done)
        self.wake.set()
        return encode(Ok(request_id=rid))

    async def _start(self, done: PrefillDone) -> None:
        rid = done.request_id
        self.spans.end(rid, "await_kv")
        self.spans.start(rid, "generate", path="pd", cached_tokens=done.cached_tokens)
        self.table.start(rid)
        self.table.get(rid).cached_tokens = done.cached_tokens
        try:
            out = self.slots.start(rid, done.first_token, done.first_logprob,
                                   done.first_top_logprobs)
        except ReplayError as e:  # prefill sampled outside our grammar: refuse, never guess
            log.error("%s: %s", rid, e)
            await self.stream.fail(rid, ErrorCode.PREFILL_FAILED,
                                   f"prefill/decode disagree: {e}", AbortReason.REPLAY_ERROR)
            return
        except Exception as e:  # noqa: BLE001 - never leave an accepted request hanging
            log.exception("%s: cannot start decoding", rid)
            await self.stream.fail(rid, ErrorCode.INTERNAL, f"decode could not start "
                                   f"({type(e).__name__})",
                                   AbortReason.START_ERROR)
            return
        await self.stream.publish(out)

    async def on_abort(self, ab: Abort) -> None:
        reason = ab.reason or AbortReason.CLIENT
        if ab.request_id in self.admitting:   # not in the table yet: aborted once it is
            self.admitting[ab.request_id] = reason
        self.reclaimer.abort(ab.request_id, reason)
        return None

    async def on_progress(self, q: ProgressQuery) -> bytes:
        """How many chunks of a request were sent: the gateway finds lost ones by asking."""
        r = self.table.get(q.request_id)
        sent = r.chunks if r is not None and r.live else -1
        return encode(ProgressReply(request_id=q.request_id, sent=sent))

    async def on_heartbeat(self, msg) -> None:
        """Prefill workers (is PD possible?) and gateways (orphans.py)."""
        try:
            hb = HEARTBEAT.decode(msg.data)
        except ContractError:
            return
        if hb.service == "gateway":
            self.gateways.heard(hb.instance_id, time.monotonic())
        elif hb.service == "prefill":
            self.prefill_seen[hb.instance_id] = time.monotonic()
            if self.kv_rx is not None:          # the only segment read for that writer
                self.kv_rx.announce(hb.instance_id, hb.shm_segment)

    async def abort_orphans(self, every_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every_s)
            for rid in self.gateways.orphans(self.table.live(), time.monotonic()):
                log.warning("%s: its gateway is gone; aborting", rid)
                self.reclaimer.abort(rid, AbortReason.GATEWAY_LOST)

    # ---- engine loop ------------------------------------------------------------------
    async def engine_loop(self) -> None:
        await run_engine_loop(self.engine, self.executor, self.wake, self.stream.publish_all,
                              self.on_step_failure)

    async def on_step_failure(self, _e: Exception) -> None:
        await self.stream.fail_running(ErrorCode.INTERNAL, "engine step failed",
                                       AbortReason.ENGINE_ERROR)
