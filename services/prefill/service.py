"""Prefill service.

Life cycle of a job:
  pull from the JetStream work queue -> check tokenizer fingerprint and block size ->
  open a write-ledger attempt and claim the job's blocks from decode (PrefillClaim;
  refused when the request was aborted meanwhile: the job is acked, nothing computed) ->
  look the prompt's prefix up in L1 (this worker's pool) and kvstore (L2/L3); load a
  kvstore hit layer by layer while computing the rest (compute on a layer waits for its
  load) -> compute the prompt (continuous batching with other jobs) and sample the first
  token with the job's sampling params -> send the prompt's KV blocks past those decode
  already caches (sender.py: at most `kv_window` unacknowledged writes, each one only
  while the ledger says the attempt may write) -> PrefillDone (first token, writes issued;
  FAILED with the count when something failed) -> ack the job; the prompt's new whole
  blocks go to kvstore in the background (writeback.py).
A Reclaim from decode cancels the attempt (reclaims.py). A worker that dies before the
ack leaves the job to be redelivered to another worker, which claims it again as a new
attempt. Test-only faults wrap the kvstore client, the transport and the sender
(inject.py); nothing here branches on them.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import nats.errors

from shared import subjects, tracing
from shared.contracts.common import Codec, ContractError, ErrorCode
from shared.contracts.messages import Heartbeat, PrefillDone, PrefillJob, PrefillStatus
from shared.engine.engine import LLMEngine
from shared.engine.output import RequestOutput
from shared.engine_loop import run_engine_loop
from shared.faults import require_allowed
from shared.jobqueue import keep_in_progress, pull_subscription
from shared.kv.nats_transport import NatsKvTransport
from shared.kv.shm import host_id
from shared.kv.shm_transport import ShmKvTransport
from shared.kv.writeback import WriteBack
from shared.precompile import precompile
from shared.service import ServiceRuntime, new_instance_id

from . import claiming, inject, layersplit
from .config import PrefillConfig
from .ledger import Phase, WriteLedger
from .peers import NatsPrefillPeers, PrefillPeers
from .reclaims import ReclaimResponder
from .sender import KvSender, Reclaimed

log = logging.getLogger("pdmesh.prefill")
JOB = Codec(PrefillJob)


class PrefillService:
    def __init__(self, cfg: PrefillConfig, engine: LLMEngine | None = None,
                 peers: PrefillPeers | None = None, kv_transport=None, kvc=None):
        """peers, kv_transport (and kvc): given for an in-process prefill (tests); else
        start() builds them over NATS."""
        self.cfg = cfg
        self.iid = cfg.instance_id or new_instance_id("prefill")
        require_allowed(cfg.faults)
        self.engine = engine or LLMEngine(inject.engine_config(cfg.engine, cfg.faults))
        self.fingerprint = self.engine.tokenizer.fingerprint
        self.rt = ServiceRuntime("prefill", self.iid, cfg.nats_url, stats=self.stats,
                                 auth=cfg.nats)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.pending: dict[str, asyncio.Future] = {}
        self.active = 0
        self.slots = asyncio.Semaphore(cfg.max_jobs)
        self.wake = asyncio.Event()
        # kv_transfer_s: summed transfer time of every job (kv_bytes / kv_transfer_s is the
        # per-job KV throughput); kv_max_write_bytes: the largest KV write payload sent
        self.counters = {"jobs_done": 0, "jobs_failed": 0, "kv_writes": 0, "kv_bytes": 0,
                         "kv_transfer_s": 0.0, "kv_max_write_bytes": 0, "bad_jobs": 0,
                         "jobs_refused": 0, "jobs_reclaimed": 0, "jobs_redelivered": 0}
        self.ledger = WriteLedger()
        self.peers, self.kvc, self.reclaims, self.sender = peers, None, None, None
        self.group = layersplit.build(cfg, self.engine)     # None unless --group-size
        self.shm: ShmKvTransport | None = None     # same-host KV writes (start())
        if kv_transport is not None:
            self.connect(peers, kv_transport, kvc)

    def connect(self, peers: PrefillPeers, kv_transport, kvc) -> None:
        """The parts that talk to other services (TEST ONLY faults wrap some of them)."""
        f = self.cfg.faults
        self.peers, self.kvc = peers, kvc
        use = self.cfg.kvstore and kvc is not None
        self.write_back = WriteBack(self.cfg.write_policy if use else "none", kvc)
        self.sender = inject.sender(KvSender(inject.transport(kv_transport, f), self.iid,
                                             self.cfg.kv_window, self.ledger,
                                             self.cfg.kv_max_write_bytes, self.cfg.kv_stream,
                                             self.cfg.kv_stream_shm,
                                             self.cfg.kv_stream_min_share), f)
        self.reclaims = ReclaimResponder(self.iid, self.ledger, self.sender, self.rt.spawn)

    async def start(self) -> None:
        await self.rt.start()
        nc = self.rt.nc
        self.psub = await pull_subscription(nc.jetstream(), self.cfg.ack_wait_s,
                                            self.cfg.max_deliver, self.cfg.max_jobs)
        kv = self.shm = await ShmKvTransport.create(
            NatsKvTransport(self.rt, self.cfg.kv_ack_timeout_s),
            size_bytes=self.cfg.kv_shm_mb << 20, enabled=self.cfg.kv_shm)
        self.connect(NatsPrefillPeers(nc), kv,
                     inject.kvstore_client(nc, self.cfg.kvstore_timeout_s, self.cfg.faults))
        await self.kvc.follow_heartbeats()
        await self.rt.endpoint("reclaim", subjects.prefill_reclaim(self.iid),
                               self.reclaims.on_reclaim, None, raw=True)
        self.rt.spawn(self.fetch_loop())
        self.rt.spawn(self.engine_loop())
        self.rt.spawn(self.reclaims.reap())
        if self.group is not None:
            self.group.start()
        log.info("prefill %s ready (model %s)", self.iid, self.cfg.model)

    async def serve(self) -> None:
        await self.start()
        await self.rt.run(heartbeat=self.heartbeat, drain=self.drain)
        try:  # a pull subscription has nothing to drain; unsubscribing keeps close() quick
            await self.psub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass
        await self.rt.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def drain(self) -> None:
        """Finish the jobs in hand (the fetch loop stops taking new ones)."""
        deadline = time.monotonic() + 10
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats()
        return Heartbeat(service="prefill", instance_id=self.iid, model=self.cfg.model,
                         tokenizer_fingerprint=self.fingerprint, running=self.active,
                         waiting=st["waiting"], blocks_free=st["blocks_free"],
                         blocks_used=st["blocks_used"], host=host_id(), ts=time.time(),
                         shm_segment=self.shm.segment if self.shm is not None else "")

    def stats(self) -> dict:
        kvc = self.kvc.counters if self.kvc is not None else {}
        answered = self.reclaims.answered if self.reclaims is not None else 0
        return (self.engine.stats() | {"jobs_active": self.active, "kv_window": self.cfg.kv_window}
                | self.counters | {"reclaims_answered": answered} | self.ledger.stats() | kvc
                | (self.sender.stats() if self.sender is not None else {})
                | {"last_load": self.engine.last_load}
                | (self.group.stats() if self.group is not None else {}))

    # ---- jobs -------------------------------------------------------------------------
    async def fetch_loop(self) -> None:
        while not self.rt.stopping.is_set():
            await self.slots.acquire()
            try:
                msgs = await self.psub.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                self.slots.release()
                continue
            except Exception as e:  # noqa: BLE001 - reconnecting
                self.slots.release()
                log.debug("fetch failed: %s", e)
                await asyncio.sleep(0.5)
                continue
            self.active += 1
            self.rt.spawn(self.run_job(msgs[0]))

    async def run_job(self, msg) -> None:
        try:
            with tracing.server("prefill", "job", getattr(msg, "headers", None), "CONSUMER"):
                if tracing.ON:
                    tracing.interval("queue", _queued_ns(msg))   # in the work queue
                await self._run_job(msg)
        finally:
            self.active -= 1
            self.slots.release()

    async def _run_job(self, msg) -> None:
        try:
            job = JOB.decode(msg.data)
        except ContractError as e:
            self.counters["bad_jobs"] += 1
            log.warning("dropping malformed job: %s", e)
            await msg.term()
            return
        problem = claiming.refuse_reason(self.engine, self.fingerprint, job)
        if problem:
            await self.finish(job, msg, claiming.failed_done(job, self.iid, *problem))
            return
        if _deliveries(msg) > 1:
            self.counters["jobs_redelivered"] += 1
        attempt = uuid.uuid4().hex[:16]
        entry = self.ledger.open(job.request_id, attempt, job.dest.instance_id)
        keepalive = self.rt.spawn(keep_in_progress(msg, self.cfg.ack_wait_s / 3))
        try:
            done = await self.attempt(job, attempt)
        finally:
            keepalive.cancel()
            self.ledger.close(attempt, time.monotonic())
        delivered = self.sender.delivered_done(attempt)
        if done is None:            # refused or reclaimed: decode wants nothing more
            await msg.ack()
            return
        if done.status is PrefillStatus.FAILED:
            done = msgspec.structs.replace(done, writes_issued=entry.issued)
        await self.finish(job, msg, done, delivered=delivered)

    async def attempt(self, job: PrefillJob, attempt: str) -> PrefillDone | None:
        """Claim, compute, write. None when decode refused the claim or reclaimed it.

        Every attempt claims first: a refused claim (the request was aborted, or a
        redelivered job's request is gone) costs no compute, and no write starts before
        the grant (the ledger). A reclaim that lands during the compute cancels the
        attempt once the compute is over."""
        local_id = f"{job.request_id}/{attempt[:8]}"
        if not await claiming.claim(self.peers, self.ledger, self.iid, job, attempt,
                                    self.cfg.claim_timeout_s):
            self.counters["jobs_refused"] += 1
            return None
        t0 = time.monotonic()
        try:
            if self.sender.will_stream(job, self.engine):     # layer-wise KV streaming
                self.sender.open(job, self.engine, local_id, attempt)
            with tracing.span("compute", prompt_tokens=len(job.prompt_ids)):
                out, tier = await self.compute(local_id, job)
            compute_s = time.monotonic() - t0
            self.sender.computed(job, self.engine, tier, compute_s)
            if self.ledger.get(attempt).phase is Phase.CANCELLED:
                raise Reclaimed(f"{job.request_id}: reclaimed before its last write")
            done = functools.partial(claiming.ok_done, job, self.iid, attempt, out, compute_s)
            return await self.transfer(job, attempt, local_id, tier, done)
        except Reclaimed as e:
            log.debug("%s", e)
            self.counters["jobs_reclaimed"] += 1
            return None
        except Exception as e:  # noqa: BLE001 - report, never crash the worker
            log.warning("%s: prefill failed: %r", job.request_id, e)
            self.ledger.stop(attempt)
            await self.sender.wait_idle(attempt)
            return claiming.failed_done(job, self.iid, ErrorCode.PREFILL_FAILED, repr(e), attempt)
        finally:
            self.pending.pop(local_id, None)     # (cancelled while computing)
            self.sender.drop(local_id)
            self.engine.release(local_id)

    async def transfer(self, job: PrefillJob, attempt: str, local_id: str, tier: int,
                       done) -> PrefillDone:
        """Send the computed prompt's KV (the only write carries `done`), then keep its
        blocks: kvstore write-back, the LayerSplit group."""
        t1 = time.monotonic()
        with tracing.span("kv_transfer", decode=job.dest.instance_id):
            writes, nbytes = await self.sender.send(job, self.engine, local_id, attempt,
                                                    final=done)
        transfer_s = time.monotonic() - t1
        for k, v in (("kv_writes", writes), ("kv_bytes", nbytes), ("kv_transfer_s", transfer_s)):
            self.counters[k] += v
        self.counters["kv_max_write_bytes"] = self.sender.max_write_bytes
        keys = self.engine.prefix_keys(job.prompt_ids, job.cache_salt)[tier:]
        kept = self.engine.port.kept_blocks(local_id)
        self.write_back(self.engine, kept[tier:tier + len(keys)], keys)
        if self.group is not None:   # the group lacks some of them: LayerSplit
            self.group.insert(self.engine, *self.engine.port.computed_prompt_blocks(local_id))
        return done(writes, nbytes, transfer_s)

    async def compute(self, local_id: str, job: PrefillJob) -> tuple[RequestOutput, int]:
        """The first token, and how many leading prompt blocks kvstore already holds."""
        kvc = self.kvc if self.cfg.kvstore else None
        tier, loader = await layersplit.lookup(
            self.group, kvc, self.engine.prefix_keys(job.prompt_ids, job.cache_salt),
            job.kvstore_blocks)
        await precompile(self.engine, job.constraint)   # off the loop (the engine's owner)
        fut = asyncio.get_running_loop().create_future()
        self.pending[local_id] = fut
        load = self.engine.add_request(local_id, job.prompt_ids, job.params, prefill_only=True,
                                       constraint=job.constraint, cache_salt=job.cache_salt,
                                       tier_blocks=tier,
                                       replay=job.resume_from)
        if load is not None:
            self.rt.spawn(loader.load(self.engine, load))
        self.wake.set()
        return await fut, tier

    async def finish(self, job: PrefillJob, msg, done: PrefillDone,
                     delivered: bool = False) -> None:
        """Report the attempt to decode (unless its only KV write carried the PrefillDone
        and decode applied it: `delivered`), then ack the job."""
        ok = done.status is PrefillStatus.OK
        self.counters["jobs_done" if ok else "jobs_failed"] += 1
        if not (ok and delivered):
            try:
                await self.peers.prefill_done(job.dest.instance_id, done, 5.0)
            except Exception as e:  # noqa: BLE001 - decode gone: it will never want this KV
                log.warning("%s: PrefillDone not delivered: %r", job.request_id, e)
        await msg.ack()

    # ---- engine loop ------------------------------------------------------------------
    async def engine_loop(self) -> None:
        await run_engine_loop(self.engine, self.executor, self.wake, self.deliver,
                              self.on_step_failure)

    async def deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            fut = self.pending.pop(o.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(o)

    async def on_step_failure(self, e: Exception) -> None:
        for rid, fut in list(self.pending.items()):
            if not fut.done():
                fut.set_exception(RuntimeError(f"engine step failed: {e!r}"))
            self.engine.abort(rid)
        self.pending.clear()


def _queued_ns(msg) -> int | None:
    """When JetStream stored the job (None: not a JetStream message)."""
    try:
        return int(msg.metadata.timestamp.timestamp() * 1e9)
    except Exception:  # noqa: BLE001 - tests' stand-ins
        return None


def _deliveries(msg) -> int:
    try:
        return msg.metadata.num_delivered
    except Exception:  # noqa: BLE001 - not a JetStream message (tests)
        return 1
