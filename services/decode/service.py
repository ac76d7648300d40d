"""Decode service: a thin handler around the request lifecycle (lifecycle.py).

Life cycle of a request:
  submit (from the gateway) -> check fingerprint and limits -> choose the path:
    colocated: the engine prefills and decodes the prompt itself;
    pd: reserve KV blocks (each stamped with an epoch) -> PrefillJob on the JetStream
        work queue -> the prefill attempt that pulls it claims the blocks (PrefillClaim;
        granted only while the request awaits KV) -> KV writes land in the reserved
        blocks (epoch-fenced) -> PrefillDone (first token, writes issued) -> join the
        continuous batch.
  -> every engine step streams TokenChunks to the gateway -> finished or aborted.
With speculative decoding on, every output also feeds the anomaly monitor (monitor.py,
invariant 5): a request it flags is aborted like any other, AnomalyEvent goes out on
pdmesh.evt.request.anomaly, and the gateway gets an ANOMALY error chunk (and
re-dispatches the request elsewhere). faults.py corrupts selected requests for tests.
Every abort (gateway Abort: client gone, timeout, explicit; decode shutdown; a failed or
silent prefill, whose request is then prefilled here in fresh blocks) goes through the
lifecycle: blocks that a claimed attempt may still write are quarantined, the attempt is
sent a Reclaim, and the blocks return to the pool only when its ReclaimAck's writes have
all arrived, or when the lease ends.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shared import subjects
from shared.contracts.common import Codec, ContractError, ErrorCode, ErrorReply, Ok, encode
from shared.contracts.kv import KvWrite, KvWriteAck, checksum
from shared.contracts.messages import (Abort, AnomalyEvent, DecodeSubmit, Heartbeat,
                                       KvDestination, Path, PrefillDone, PrefillStatus,
                                       SubmitAck, TokenChunk)
from shared.contracts.reclaim import ClaimReply, PrefillClaim, Reclaim, ReclaimAck
from shared.engine.block_pool import NoFreeBlocks
from shared.engine.engine import LLMEngine
from shared.engine.grammar import ReplayError
from shared.engine.kv_transfer import unpack_into
from shared.engine.output import RequestOutput
from shared.engine_loop import run_engine_loop
from shared.jobqueue import ensure_stream
from shared.kvstore_client import KvstoreClient
from shared.service import ServiceError, ServiceRuntime, decode_reply, new_instance_id

from . import faults
from .config import DecodeConfig
from .jobs import make_prefill_job
from .lifecycle import WANTS_KV, Lifecycle, Next, Plan, State
from .monitor import RULES, AnomalyMonitor

log = logging.getLogger("pdmesh.decode")
RECLAIM_ACK = Codec(ReclaimAck)
SWEEP_S = 0.1


@dataclass(slots=True)
class Tracked:
    """Where a live request's tokens go (its lifecycle state is in Lifecycle)."""
    reply_subject: str
    path: Path
    submitted: float
    chunks: int = 0                                       # TokenChunks sent (their seq)
    cached_tokens: int = 0                                # prefill's prefix-cache hit
    fault: str | None = None                              # TEST ONLY: faults.select()
    fault_seed: int = 0
    kv_blocks: list[int] = field(default_factory=list)    # PD: the blocks prefill writes


class DecodeService:
    def __init__(self, cfg: DecodeConfig, engine: LLMEngine | None = None):
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("decode")
        self.engine = engine or LLMEngine(cfg.engine_config())
        self.fingerprint = self.engine.tokenizer.fingerprint
        self.rt = ServiceRuntime("decode", self.iid, cfg.nats_url, stats=self.stats)
        self.tracked: dict[str, Tracked] = {}
        self.life = Lifecycle(cfg.reclaim_lease_s, cfg.reclaim_timeout_s,
                              reclaim_ack=not cfg.fault_no_reclaim_ack)
        self.prefill_seen: dict[str, float] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.wake = asyncio.Event()
        self.accepting = True
        self.counters = {"pd": 0, "colocated": 0, "kv_writes_applied": 0, "kv_writes_fenced": 0,
                         "kv_bytes": 0, "prefill_fallbacks": 0}
        speculating = self.engine.cfg.speculative and cfg.monitor
        self.monitor = AnomalyMonitor(cfg.monitor_config()) if speculating else None
        self.fault_kinds = cfg.fault_kinds()
        self.faults_injected = dict.fromkeys(self.fault_kinds, 0)
        self.repeat_token = (self.engine.tokenizer.encode(" the")[-1]
                             if self.engine.tokenizer is not None else 1)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.rt.start()
        nc = self.rt.nc
        self.js = nc.jetstream()
        await ensure_stream(self.js)
        self.kvc = KvstoreClient(nc, self.cfg.kvstore_timeout_s)
        await self.rt.endpoint("submit", subjects.decode_submit(self.iid), self.on_submit,
                               Codec(DecodeSubmit))
        await self.rt.endpoint("abort", subjects.decode_abort(self.iid), self.on_abort,
                               Codec(Abort))
        await self.rt.endpoint("kv", subjects.decode_kv(self.iid), self.on_kv, None, raw=True)
        await self.rt.endpoint("prefill_done", subjects.decode_prefill_done(self.iid),
                               self.on_prefill_done, Codec(PrefillDone))
        await self.rt.endpoint("claim", subjects.decode_claim(self.iid), self.on_claim,
                               Codec(PrefillClaim))
        await nc.subscribe(subjects.heartbeat("prefill"), cb=self.on_prefill_heartbeat)
        self.rt.spawn(self.engine_loop())
        self.rt.spawn(self.watchdog())
        log.info("decode %s ready (model %s, %d KV blocks)", self.iid, self.cfg.model,
                 self.engine.pool.num_blocks)

    async def serve(self) -> None:
        await self.start()
        await self.rt.run(heartbeat=self.heartbeat, drain=self.drain)
        await self.rt.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let running requests finish, abort the rest, and give
        their reclaims a moment (so prefill stops writing for requests that are gone)."""
        self.accepting = False
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for rid in list(self.tracked):
            await self.fail(rid, ErrorCode.SHUTTING_DOWN, "decode instance shut down",
                            reason="shutdown")
        deadline = time.monotonic() + min(self.cfg.reclaim_lease_s, 3 * self.cfg.reclaim_timeout_s)
        while self.life.quarantine and time.monotonic() < deadline:
            await asyncio.sleep(SWEEP_S)

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats()
        return Heartbeat(service="decode", instance_id=self.iid, model=self.cfg.model,
                         tokenizer_fingerprint=self.fingerprint, running=st["running"],
                         waiting=st["waiting"], queue_depth=len(self.engine.remote),
                         blocks_free=st["blocks_free"], blocks_used=st["blocks_used"],
                         blocks_quarantined=st["blocks_quarantined"],
                         accepting=self.accepting, max_model_len=self.engine.max_model_len,
                         ts=time.time())

    def stats(self) -> dict:
        kvc = self.kvc.counters if hasattr(self, "kvc") else {}
        counts = self.monitor.counts if self.monitor is not None else {}
        anomalies = {f"anomaly_{rule}": counts.get(rule, 0) for rule in RULES}
        injected = {f"fault_{k}_injected": n for k, n in self.faults_injected.items()}
        return (self.engine.stats() | {"awaiting_kv": len(self.engine.remote),
                                       "requests": len(self.tracked)}
                | self.counters | self.life.stats() | kvc | anomalies | injected)

    # ---- handlers ---------------------------------------------------------------------
    async def on_submit(self, sub: DecodeSubmit) -> bytes:
        if not self.accepting:
            raise ServiceError(ErrorCode.SHUTTING_DOWN, "decode is draining", sub.request_id)
        if sub.tokenizer_fingerprint != self.fingerprint:
            raise ServiceError(ErrorCode.TOKENIZER_MISMATCH,
                               "tokenizer fingerprint differs from this decode instance's",
                               sub.request_id)
        if sub.request_id in self.tracked or self.life.state(sub.request_id) is not None:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "duplicate request id", sub.request_id)
        rid = sub.request_id
        fault = faults.select(sub.params.seed, self.cfg.fault_select_seed_mod, self.fault_kinds)
        params = sub.params
        if fault == faults.REPEAT_LOOP:
            params = faults.repeat_loop(params, self.repeat_token)
        try:
            self.engine.check_request(sub.prompt_ids, params)
            path = self.choose_path(sub)
            if path is Path.PD:
                tier = 0
                if self.cfg.kvstore:
                    tier = await self.kvc.lookup(self.engine.prefix_keys(sub.prompt_ids))
                res = self.engine.reserve_remote(rid, sub.prompt_ids, params,
                                                 sub.constraint, tier_blocks=tier)
                blocks, epochs, skip = res.blocks, res.epochs, res.skip
                if res.load is not None:
                    self.rt.spawn(self.kvc.load(self.engine, res.load))
            else:
                self.engine.add_request(rid, sub.prompt_ids, params, constraint=sub.constraint)
        except NoFreeBlocks:
            path = Path.COLOCATED   # queue locally rather than refuse
            self.engine.add_request(rid, sub.prompt_ids, params, constraint=sub.constraint)
        except ValueError as e:     # limits, ids, an uncompilable constraint
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), rid) from e
        tr = Tracked(sub.reply_subject, path, time.monotonic())
        self.tracked[rid] = tr
        if fault == faults.REPEAT_LOOP:
            self.faults_injected[fault] += 1
        elif fault is not None and path is Path.PD:     # KV faults: applied once it arrived
            tr.fault, tr.fault_seed, tr.kv_blocks = fault, sub.params.seed, list(blocks)
        if path is Path.PD:
            self.life.admit_remote(rid, blocks, epochs)
            try:
                await self.dispatch_prefill(sub, blocks, epochs, skip)
                self.life.queued(rid)
            except Exception as e:  # noqa: BLE001 - fall back, never fail
                log.info("%s: PD dispatch failed (%s); prefilling locally", rid, e)
                if self.life.state(rid) in WANTS_KV:
                    self.fallback_local(rid, "dispatch_failed")
        else:
            self.life.admit_local(rid)
        self.counters[tr.path.value] += 1
        self.wake.set()
        return encode(SubmitAck(request_id=rid, path=tr.path))

    def choose_path(self, sub: DecodeSubmit) -> Path:
        if sub.force_path is not None:
            return sub.force_path
        if self.cfg.mode == "colocated":
            return Path.COLOCATED
        if self.cfg.mode == "pd":
            return Path.PD
        alive = any(time.monotonic() - t < self.cfg.prefill_dead_after_s
                    for t in self.prefill_seen.values())
        uncached = len(sub.prompt_ids) - self.engine.cached_prefix_tokens(sub.prompt_ids)
        if alive and uncached >= self.cfg.min_pd_prompt_tokens:
            return Path.PD
        return Path.COLOCATED

    async def dispatch_prefill(self, sub: DecodeSubmit, blocks: list[int],
                               epochs: list[int], skip: int = 0) -> None:
        dest = KvDestination(instance_id=self.iid, block_ids=blocks, epochs=epochs,
                             skip_blocks=skip)
        job = make_prefill_job(sub, dest, self.cfg.model, self.cfg.block_size,
                               drop_constraint=self.cfg.fault_drop_constraint_in_job)
        await self.js.publish(subjects.prefill_jobs(), encode(job), timeout=5)

    async def on_claim(self, c: PrefillClaim) -> bytes:
        granted, why = self.life.claim(c.request_id, c.attempt, c.prefill_instance,
                                       c.block_ids, c.epochs)
        return encode(ClaimReply(request_id=c.request_id, granted=granted, reason=why))

    async def on_kv(self, req) -> bytes:
        w = KvWrite.from_headers(req.headers)
        data = req.data
        if checksum(data) != w.checksum:
            raise ContractError(f"KV write {w.request_id}#{w.seq}: checksum mismatch")
        eng = self.engine
        self.life.write(w.request_id, w.attempt or w.sender)   # counted, landed or not
        try:
            with eng.lock:
                landed = eng.accept_kv(w.block_ids, w.epochs)
                if landed:
                    unpack_into(eng.kv, w.block_ids, w.layer_start, w.layer_end, data, w.dtype,
                                w.shape)
        except ValueError as e:
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), w.request_id) from e
        finally:
            if self.life.settled(w.request_id):
                self.release(w.request_id, "acked")
        if landed:
            self.counters["kv_writes_applied"] += 1
            self.counters["kv_bytes"] += len(data)
        else:
            self.counters["kv_writes_fenced"] += 1
        return encode(KvWriteAck(request_id=w.request_id, seq=w.seq, applied=landed))

    async def on_prefill_done(self, done: PrefillDone) -> bytes:
        rid = done.request_id
        attempt = done.attempt or done.prefill_instance
        ok = done.status is PrefillStatus.OK
        nxt = self.life.prefill_done(rid, attempt, ok, done.writes_issued)
        if self.life.settled(rid):
            self.release(rid, "acked")
        if nxt is Next.FALLBACK:
            got = self.life.writes_received(rid, attempt)
            log.warning("%s: prefill %s (%s, %d/%d writes); prefilling locally", rid,
                        done.status.value, done.error.message if done.error else "", got,
                        done.writes_issued)
            self.fallback_local(rid, "prefill_failed")
        elif nxt is Next.START:
            self.life.start(rid)
            tr = self.tracked.get(rid)
            if tr is not None:
                tr.cached_tokens = done.cached_tokens
                if tr.fault is not None:
                    self.inject_kv_fault(rid, tr)
            try:
                out = self.engine.start_remote(rid, done.first_token, done.first_logprob,
                                               done.first_top_logprobs)
            except ReplayError as e:  # prefill sampled outside our grammar: refuse, never guess
                log.error("%s: %s", rid, e)
                await self.fail(rid, ErrorCode.PREFILL_FAILED, f"prefill/decode disagree: {e}",
                                reason="replay_error")
                return encode(Ok(request_id=rid))
            except Exception as e:  # noqa: BLE001 - never leave an accepted request hanging
                log.exception("%s: cannot start decoding", rid)
                await self.fail(rid, ErrorCode.INTERNAL, f"decode could not start: {e!r}",
                                reason="start_error")
                return encode(Ok(request_id=rid))
            await self.publish(out)
            self.wake.set()
        return encode(Ok(request_id=rid))

    async def on_abort(self, ab: Abort) -> None:
        self.abort(ab.request_id, ab.reason or "client")
        return None

    async def on_prefill_heartbeat(self, msg) -> None:
        try:
            hb = Codec(Heartbeat).decode(msg.data)
        except ContractError:
            return
        self.prefill_seen[hb.instance_id] = time.monotonic()

    def inject_kv_fault(self, rid: str, tr: Tracked) -> None:
        """TEST ONLY: corrupt the prompt KV prefill wrote, before the request decodes."""
        eng = self.engine
        with eng.lock:
            others = [b for s in eng.scheduler.running if s.request_id != rid
                      for b in s.block_table[:eng.pool.blocks_for(s.num_computed)]]
            faults.corrupt(tr.fault, eng.kv, tr.kv_blocks, tr.fault_seed, others,
                           self.cfg.fault_noise_scale)
        self.faults_injected[tr.fault] += 1
        log.warning("%s: TEST ONLY fault %s injected into %d KV blocks", rid, tr.fault,
                    len(tr.kv_blocks))

    # ---- engine loop ------------------------------------------------------------------
    async def engine_loop(self) -> None:
        await run_engine_loop(self.engine, self.executor, self.wake, self.publish_all,
                              self.on_step_failure)

    async def publish_all(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            await self.publish(o)

    async def on_step_failure(self, _e: Exception) -> None:
        for rid in list(self.tracked):
            if self.life.state(rid) is State.RUNNING:
                await self.fail(rid, ErrorCode.INTERNAL, "engine step failed",
                                reason="engine_error")

    @staticmethod
    def cached_tokens(o: RequestOutput, tr: Tracked) -> int:
        """Prompt tokens not computed: prefill's count on the PD path (decode's own hits
        only spare transfer), the engine's when it prefilled here. Final chunk only."""
        if not o.finished:
            return 0
        return tr.cached_tokens if tr.path is Path.PD else o.num_cached_tokens

    async def publish(self, o: RequestOutput) -> None:
        tr = self.tracked.get(o.request_id)
        if tr is None:
            return
        if self.monitor is not None:
            rule = self.monitor.observe_totals(o.request_id, o.spec_steps, o.spec_proposed,
                                               o.spec_accepted, o.num_output_tokens)
            if rule is not None:   # this output's tokens are not sent: they are suspect
                await self.on_anomaly(o, rule)
                return
        chunk = TokenChunk(request_id=o.request_id, token_ids=o.new_token_ids, text=o.text,
                           logprobs=o.logprobs, finished=o.finished,
                           finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                           prompt_tokens=o.num_prompt_tokens,
                           completion_tokens=o.num_output_tokens, path=tr.path,
                           seq=tr.chunks,
                           cached_tokens=self.cached_tokens(o, tr),
                           spec_steps=o.spec_steps, spec_proposed=o.spec_proposed,
                           spec_accepted=o.spec_accepted)
        tr.chunks += 1
        if o.finished:
            self.tracked.pop(o.request_id, None)
            self.life.finish(o.request_id)
            if self.monitor is not None:
                self.monitor.forget(o.request_id)
        try:
            await self.rt.nc.publish(tr.reply_subject, encode(chunk))
        except Exception as e:  # noqa: BLE001 - gateway notices via its own timeouts
            log.warning("%s: cannot publish tokens: %s", o.request_id, e)

    async def on_anomaly(self, o: RequestOutput, rule: str) -> None:
        """Invariant 5: the monitor flagged the request. Abort it like any other (reclaim
        applies) with an ANOMALY error the gateway acts on, then tell whoever listens."""
        st = self.monitor.stats(o.request_id)
        ev = AnomalyEvent(request_id=o.request_id, instance_id=self.iid, rule=rule,
                          accept_length=round(st.accept_length, 4),
                          accept_rate=round(st.accept_rate, 4),
                          generated_tokens=o.num_output_tokens, ts=time.time())
        log.warning("%s: anomaly %s (accept length %.2f, accept rate %.3f, %d tokens); "
                    "aborting", o.request_id, rule, ev.accept_length, ev.accept_rate,
                    ev.generated_tokens)
        await self.fail(o.request_id, ErrorCode.ANOMALY,
                        f"speculative decoding acceptance anomaly ({rule}: accept length "
                        f"{ev.accept_length:.2f}, accept rate {ev.accept_rate:.3f} after "
                        f"{ev.generated_tokens} tokens); the output is discarded",
                        reason="anomaly", rule=rule)
        try:
            await self.rt.nc.publish(subjects.request_anomaly(), encode(ev))
        except Exception as e:  # noqa: BLE001 - the request is handled; only the event is lost
            log.warning("%s: cannot publish the anomaly event: %s", o.request_id, e)

    # ---- aborts and reclaims --------------------------------------------------------
    def abort(self, rid: str, reason: str) -> Tracked | None:
        """Every abort path ends here: the request leaves the batch; blocks a prefill may
        still write are quarantined and their writers asked to stop."""
        tr = self.tracked.pop(rid, None)
        if self.monitor is not None:
            self.monitor.forget(rid)
        plan = self.life.abort(rid, reason, time.monotonic())
        if plan is Plan.QUARANTINE:
            self.engine.abort(rid, quarantine=True)
            self.ask_owners()
        elif plan is not Plan.UNKNOWN:
            self.engine.abort(rid)
        return tr

    async def fail(self, rid: str, code: ErrorCode, message: str, reason: str,
                   rule: str = "") -> None:
        tr = self.abort(rid, reason)
        if tr is not None:
            err = ErrorReply(code=code, message=message, request_id=rid)
            chunk = TokenChunk(request_id=rid, finished=True, finish_reason="abort", error=err,
                               path=tr.path, seq=tr.chunks, anomaly_rule=rule)
            try:
                await self.rt.nc.publish(tr.reply_subject, encode(chunk))
            except Exception:  # noqa: BLE001
                pass

    def fallback_local(self, rid: str, reason: str) -> None:
        """Prefill here, in fresh blocks; the reserved ones are reclaimed like an abort's."""
        plan = self.life.fallback(rid, reason, time.monotonic())
        self.engine.prefill_locally(rid, quarantine=plan is Plan.QUARANTINE)
        tr = self.tracked.get(rid)
        if tr is not None:
            tr.path = Path.COLOCATED
        self.counters["prefill_fallbacks"] += 1
        if plan is Plan.QUARANTINE:
            self.ask_owners()
        self.wake.set()

    def release(self, rid: str, outcome: str) -> None:
        """ABORTING -> RECLAIMED: the quarantined blocks go back to the pool."""
        self.engine.release_quarantined(rid)
        self.life.reclaimed(rid, outcome, time.monotonic())
        if outcome == "lease":
            log.warning("%s: no reclaim answer within %.1fs; blocks freed (epoch-fenced)", rid,
                        self.cfg.reclaim_lease_s)

    def ask_owners(self) -> None:
        for rid, attempt, instance in self.life.to_ask(time.monotonic()):
            self.rt.spawn(self.send_reclaim(rid, attempt, instance))

    async def send_reclaim(self, rid: str, attempt: str, instance: str) -> None:
        q = self.life.quarantine.get(rid)
        msg = Reclaim(request_id=rid, attempt=attempt, decode_instance=self.iid,
                      reason=q.reason if q else "")
        try:
            reply = await self.rt.nc.request(subjects.prefill_reclaim(instance), encode(msg),
                                             timeout=self.cfg.reclaim_timeout_s)
            ack = decode_reply(reply.data, reply.headers, RECLAIM_ACK)
        except Exception as e:  # noqa: BLE001 - asked again after reclaim_timeout_s, or the lease ends it
            log.debug("%s: reclaim of %s on %s unanswered: %r", rid, attempt, instance, e)
            return
        self.life.reclaim_ack(rid, ack.attempt, ack.owner, ack.writes_issued)
        if self.life.settled(rid):
            self.release(rid, "acked")

    async def watchdog(self) -> None:
        """Requests whose KV never arrives are prefilled here; quarantines whose writers
        answered (or whose lease ran out) end; silent writers are asked again."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for rid, outcome in self.life.ready(now):
                self.release(rid, outcome)
            self.ask_owners()
            for rid, tr in list(self.tracked.items()):
                if now - tr.submitted > self.cfg.prefill_timeout_s \
                        and self.life.state(rid) in WANTS_KV:
                    log.warning("%s: no KV after %.0fs; prefilling locally", rid,
                                now - tr.submitted)
                    self.fallback_local(rid, "prefill_timeout")
