"""Decode service.

Life cycle of a request:
  submit (from the gateway) -> check fingerprint and limits -> choose the path:
    colocated: the engine prefills and decodes the prompt itself;
    pd: reserve KV blocks (each stamped with an epoch) -> PrefillJob on the JetStream
        work queue -> KV writes land in the reserved blocks (epoch-fenced) ->
        PrefillDone (first token, writes issued) -> join the continuous batch.
  -> every engine step streams TokenChunks to the gateway -> finished or aborted.
If the prefill never completes (no live prefill worker, timeout, failure) the request is
prefilled here instead, in fresh blocks, so a late write cannot land in it.
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
from shared.contracts.messages import (Abort, DecodeSubmit, Heartbeat, KvDestination, Path,
                                       PrefillDone, PrefillStatus, SubmitAck, TokenChunk)
from shared.engine.block_pool import NoFreeBlocks
from shared.engine.engine import LLMEngine
from shared.engine.grammar import ReplayError
from shared.engine.kv_transfer import unpack_into
from shared.engine.output import RequestOutput
from shared.jobqueue import ensure_stream
from shared.service import ServiceError, ServiceRuntime, new_instance_id

from .config import DecodeConfig
from .jobs import make_prefill_job

log = logging.getLogger("pdmesh.decode")


@dataclass(slots=True)
class Tracked:
    """What the service knows about a request beyond the engine's view."""
    reply_subject: str
    path: Path
    submitted: float
    writes: dict[str, int] = field(default_factory=dict)   # KV writes applied, per sender
    awaiting_kv: bool = False
    chunks: int = 0                                       # TokenChunks sent (their seq)


class DecodeService:
    def __init__(self, cfg: DecodeConfig, engine: LLMEngine | None = None):
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("decode")
        self.engine = engine or LLMEngine(cfg.engine_config())
        self.fingerprint = self.engine.tokenizer.fingerprint
        self.rt = ServiceRuntime("decode", self.iid, cfg.nats_url, stats=self.stats)
        self.tracked: dict[str, Tracked] = {}
        self.prefill_seen: dict[str, float] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.wake = asyncio.Event()
        self.accepting = True
        self.counters = {"pd": 0, "colocated": 0, "kv_writes_applied": 0, "kv_writes_fenced": 0,
                         "kv_bytes": 0, "prefill_fallbacks": 0, "aborts": 0}

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.rt.start()
        nc = self.rt.nc
        self.js = nc.jetstream()
        await ensure_stream(self.js)
        await self.rt.endpoint("submit", subjects.decode_submit(self.iid), self.on_submit,
                               Codec(DecodeSubmit))
        await self.rt.endpoint("abort", subjects.decode_abort(self.iid), self.on_abort,
                               Codec(Abort))
        await self.rt.endpoint("kv", subjects.decode_kv(self.iid), self.on_kv, None, raw=True)
        await self.rt.endpoint("prefill_done", subjects.decode_prefill_done(self.iid),
                               self.on_prefill_done, Codec(PrefillDone))
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
        """SIGTERM: refuse new work, let running requests finish, then abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for rid in list(self.tracked):
            await self.fail(rid, ErrorCode.SHUTTING_DOWN, "decode instance shut down")

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats()
        return Heartbeat(service="decode", instance_id=self.iid, model=self.cfg.model,
                         tokenizer_fingerprint=self.fingerprint, running=st["running"],
                         waiting=st["waiting"], queue_depth=len(self.engine.remote),
                         blocks_free=st["blocks_free"], blocks_used=st["blocks_used"],
                         accepting=self.accepting, max_model_len=self.engine.max_model_len,
                         ts=time.time())

    def stats(self) -> dict:
        return self.engine.stats() | {"awaiting_kv": len(self.engine.remote),
                                      "requests": len(self.tracked)} | self.counters

    # ---- handlers ---------------------------------------------------------------------
    async def on_submit(self, sub: DecodeSubmit) -> bytes:
        if not self.accepting:
            raise ServiceError(ErrorCode.SHUTTING_DOWN, "decode is draining", sub.request_id)
        if sub.tokenizer_fingerprint != self.fingerprint:
            raise ServiceError(ErrorCode.TOKENIZER_MISMATCH,
                               "tokenizer fingerprint differs from this decode instance's",
                               sub.request_id)
        if sub.request_id in self.tracked:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "duplicate request id", sub.request_id)
        try:
            self.engine.check_request(sub.prompt_ids, sub.params)
            path = self.choose_path(sub)
            if path is Path.PD:
                blocks, epochs = self.engine.reserve_remote(sub.request_id, sub.prompt_ids,
                                                            sub.params, sub.constraint)
            else:
                self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params,
                                        constraint=sub.constraint)
        except NoFreeBlocks:
            path = Path.COLOCATED   # queue locally rather than refuse
            self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params,
                                    constraint=sub.constraint)
        except ValueError as e:     # limits, ids, an uncompilable constraint
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), sub.request_id) from e
        tr = Tracked(sub.reply_subject, path, time.monotonic())
        self.tracked[sub.request_id] = tr
        if path is Path.PD:
            tr.awaiting_kv = True
            try:
                await self.dispatch_prefill(sub, blocks, epochs)
            except Exception as e:  # noqa: BLE001 - fall back, never fail
                log.info("%s: PD dispatch failed (%s); prefilling locally", sub.request_id, e)
                self.fallback_local(sub.request_id, tr)
        self.counters[tr.path.value] += 1
        self.wake.set()
        return encode(SubmitAck(request_id=sub.request_id, path=tr.path))

    def choose_path(self, sub: DecodeSubmit) -> Path:
        if sub.force_path is not None:
            return sub.force_path
        if self.cfg.mode == "colocated":
            return Path.COLOCATED
        if self.cfg.mode == "pd":
            return Path.PD
        alive = any(time.monotonic() - t < self.cfg.prefill_dead_after_s
                    for t in self.prefill_seen.values())
        if alive and len(sub.prompt_ids) >= self.cfg.min_pd_prompt_tokens:
            return Path.PD
        return Path.COLOCATED

    async def dispatch_prefill(self, sub: DecodeSubmit, blocks: list[int],
                               epochs: list[int]) -> None:
        dest = KvDestination(instance_id=self.iid, block_ids=blocks, epochs=epochs)
        job = make_prefill_job(sub, dest, self.cfg.model, self.cfg.block_size,
                               drop_constraint=self.cfg.fault_drop_constraint_in_job)
        await self.js.publish(subjects.prefill_jobs(), encode(job), timeout=5)

    async def on_kv(self, req) -> bytes:
        w = KvWrite.from_headers(req.headers)
        data = req.data
        if checksum(data) != w.checksum:
            raise ContractError(f"KV write {w.request_id}#{w.seq}: checksum mismatch")
        eng = self.engine
        with eng.lock:
            applied = eng.accept_kv(w.request_id, w.block_ids, w.epochs)
            if applied:
                try:
                    unpack_into(eng.kv, w.block_ids, w.layer_start, w.layer_end, data, w.dtype,
                                w.shape)
                except ValueError as e:
                    raise ServiceError(ErrorCode.INVALID_REQUEST, str(e), w.request_id) from e
        tr = self.tracked.get(w.request_id)
        if applied and tr is not None:
            tr.writes[w.sender] = tr.writes.get(w.sender, 0) + 1
            self.counters["kv_writes_applied"] += 1
            self.counters["kv_bytes"] += len(data)
        else:
            self.counters["kv_writes_fenced"] += 1
        return encode(KvWriteAck(request_id=w.request_id, seq=w.seq, applied=applied))

    async def on_prefill_done(self, done: PrefillDone) -> bytes:
        rid = done.request_id
        tr = self.tracked.get(rid)
        if tr is None or not tr.awaiting_kv or rid not in self.engine.remote:
            return encode(Ok(request_id=rid))   # late or duplicate: nothing to do
        got = tr.writes.get(done.prefill_instance, 0)
        if done.status is not PrefillStatus.OK or got != done.writes_issued:
            log.warning("%s: prefill %s (%s, %d/%d writes); prefilling locally", rid,
                        done.status.value, done.error.message if done.error else "", got,
                        done.writes_issued)
            self.fallback_local(rid, tr)
            return encode(Ok(request_id=rid))
        tr.awaiting_kv = False
        try:
            out = self.engine.start_remote(rid, done.first_token, done.first_logprob,
                                           done.first_top_logprobs)
        except ReplayError as e:  # prefill sampled outside our grammar: refuse, never guess
            log.error("%s: %s", rid, e)
            await self.fail(rid, ErrorCode.PREFILL_FAILED, f"prefill/decode disagree: {e}")
            return encode(Ok(request_id=rid))
        await self.publish(out)
        self.wake.set()
        return encode(Ok(request_id=rid))

    async def on_abort(self, ab: Abort) -> None:
        if ab.request_id in self.tracked:
            self.counters["aborts"] += 1
            self.engine.abort(ab.request_id)
            self.tracked.pop(ab.request_id, None)
        return None

    async def on_prefill_heartbeat(self, msg) -> None:
        try:
            hb = Codec(Heartbeat).decode(msg.data)
        except ContractError:
            return
        self.prefill_seen[hb.instance_id] = time.monotonic()

    # ---- engine loop ------------------------------------------------------------------
    async def engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished:
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                outs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed")
                for rid in list(self.tracked):
                    if rid not in self.engine.remote:
                        await self.fail(rid, ErrorCode.INTERNAL, "engine step failed")
                continue
            for o in outs:
                await self.publish(o)
            await asyncio.sleep(0)

    async def publish(self, o: RequestOutput) -> None:
        tr = self.tracked.get(o.request_id)
        if tr is None:
            return
        chunk = TokenChunk(request_id=o.request_id, token_ids=o.new_token_ids, text=o.text,
                           logprobs=o.logprobs, finished=o.finished,
                           finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                           prompt_tokens=o.num_prompt_tokens,
                           completion_tokens=o.num_output_tokens, path=tr.path,
                           seq=tr.chunks)
        tr.chunks += 1
        if o.finished:
            self.tracked.pop(o.request_id, None)
        try:
            await self.rt.nc.publish(tr.reply_subject, encode(chunk))
        except Exception as e:  # noqa: BLE001 - gateway notices via its own timeouts
            log.warning("%s: cannot publish tokens: %s", o.request_id, e)

    async def fail(self, rid: str, code: ErrorCode, message: str) -> None:
        tr = self.tracked.pop(rid, None)
        self.engine.abort(rid)
        if tr is not None:
            err = ErrorReply(code=code, message=message, request_id=rid)
            chunk = TokenChunk(request_id=rid, finished=True, finish_reason="abort", error=err,
                               path=tr.path, seq=tr.chunks)
            try:
                await self.rt.nc.publish(tr.reply_subject, encode(chunk))
            except Exception:  # noqa: BLE001
                pass

    def fallback_local(self, rid: str, tr: Tracked) -> None:
        tr.awaiting_kv = False
        tr.path = Path.COLOCATED
        self.counters["prefill_fallbacks"] += 1
        self.engine.prefill_locally(rid)
        self.wake.set()

    async def watchdog(self) -> None:
        """Requests whose KV never arrives are prefilled here."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, tr in list(self.tracked.items()):
                if tr.awaiting_kv and now - tr.submitted > self.cfg.prefill_timeout_s \
                        and rid in self.engine.remote:
                    log.warning("%s: no KV after %.0fs; prefilling locally", rid,
                                now - tr.submitted)
                    self.fallback_local(rid, tr)
