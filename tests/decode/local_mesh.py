"""Decode and prefill in one process, no NATS, no subprocesses: each service's peers call
the other's handlers directly and KV goes through the in-memory KV transport. The test
drives every step (submit, run a job, abort, sweep), so the lifecycle's hard cases happen
in exactly the order the test names, without sleeps."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from shared.contracts.common import Codec, encode
from shared.contracts.messages import Abort, DecodeSubmit, PrefillJob, SubmitAck, TokenChunk
from shared.contracts.reclaim import ClaimReply, ReclaimAck
from shared.contracts.sampling import SamplingParams
from shared.kv.memory_transport import InMemoryKvTransport
from shared.settings import build

DET = {"deterministic": True, "dtype": "float32", "threads": 1, "block_size": 16,
       "chunk_size": 32, "max_num_batched_tokens": 128}
CLAIM_REPLY, RECLAIM_ACK, SUBMIT_ACK = Codec(ClaimReply), Codec(ReclaimAck), Codec(SubmitAck)
MAX_TOKENS = 8          # what the tests generate (conftest's `reference` too)


async def until(pred, steps: int = 2000) -> None:
    """Let the loop run until pred() holds (no wall-clock sleeps: yields only)."""
    for _ in range(steps):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


class Gate:
    """A KV transport whose writes wait at a gate: `waiting` is set once a write is in
    flight (issued, not yet delivered); `open()` lets them all through."""

    def __init__(self, inner):
        self.inner = inner
        self.waiting = asyncio.Event()
        self._open = asyncio.Event()

    @property
    def max_payload(self) -> int:
        return self.inner.max_payload

    def open(self) -> None:
        self._open.set()

    async def send(self, dest, meta, payload):
        self.waiting.set()
        await self._open.wait()
        return await self.inner.send(dest, meta, payload)

    async def listen(self, instance_id, on_write, admit=None):
        await self.inner.listen(instance_id, on_write, admit)

    async def close(self):
        await self.inner.close()


class JobMsg:
    """A work-queue message as prefill sees it (ack/term/in_progress, delivery count)."""

    def __init__(self, job: PrefillJob, delivered: int = 1):
        self.data = encode(job)
        self.acked = self.termed = False
        self.metadata = type("Meta", (), {"num_delivered": delivered})()

    async def ack(self):
        self.acked = True

    async def term(self):
        self.termed = True

    async def in_progress(self):
        pass


class LocalReply:
    def __init__(self, data: bytes):
        self.data = data
        self.answer = asyncio.get_running_loop().create_future()

    async def respond(self, data: bytes, headers=None):
        self.answer.set_result(data)


class LocalMesh:
    def __init__(self, model, decode: dict | None = None, prefill: dict | None = None,
                 gated: bool = False):
        base = {"model": str(model), "kvstore": False} | DET
        self.decode = DecodeService(build(DecodeConfig, base | {"mode": "pd"} | (decode or {})),
                                    peers=self)
        self.kv = InMemoryKvTransport()
        self.gate = Gate(self.kv) if gated else None
        self.prefill = PrefillService(build(PrefillConfig, base | (prefill or {})), peers=self,
                                      kv_transport=self.gate or self.kv)
        self.jobs: list[PrefillJob] = []
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self.finished: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.prefill_dead = False
        self.tasks: list[asyncio.Task] = []
        self.dones: list = []            # PrefillDone messages sent on their own
        self.claim_gate = None           # an async callable a claim awaits before decode sees it

    async def start(self, decode_loop: bool = True) -> None:
        await self.kv.listen(self.decode.iid, self.decode.on_kv_write, self.decode.admits)
        self.tasks.append(asyncio.ensure_future(self.prefill.engine_loop()))
        if decode_loop:
            self.start_decoding()

    def start_decoding(self) -> None:
        self.tasks.append(asyncio.ensure_future(self.decode.engine_loop()))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for svc in (self.decode, self.prefill):
            svc.executor.shutdown(wait=True)

    # ---- driving --------------------------------------------------------------------
    async def submit(self, rid: str, prompt: list[int], **params) -> SubmitAck:
        sp = SamplingParams(**({"temperature": 0.0, "seed": 1} | params))
        sub = DecodeSubmit(request_id=rid, prompt_ids=prompt, params=sp,
                           tokenizer_fingerprint=self.decode.fingerprint, reply_subject="inbox")
        return SUBMIT_ACK.decode(await self.decode.on_submit(sub))

    def run_job(self, delivered: int = 1) -> tuple[asyncio.Task, JobMsg]:
        """Prefill takes the oldest queued job (as a pull from the work queue would)."""
        msg = JobMsg(self.jobs.pop(0), delivered)
        return asyncio.ensure_future(self.prefill._run_job(msg)), msg

    async def abort(self, rid: str) -> None:
        await self.decode.on_abort(Abort(request_id=rid))

    async def tokens(self, rid: str, timeout: float = 60) -> list[int]:
        await asyncio.wait_for(self.finished[rid].wait(), timeout)
        return [t for c in self.chunks[rid] for t in c.token_ids]

    # ---- decode's peers -------------------------------------------------------------
    async def send_chunk(self, subject: str, chunk: TokenChunk) -> None:
        self.chunks[chunk.request_id].append(chunk)
        if chunk.finished:
            self.finished[chunk.request_id].set()

    async def queue_job(self, job: PrefillJob) -> None:
        self.jobs.append(job)

    async def reclaim(self, instance, msg, timeout) -> ReclaimAck:
        if self.prefill_dead:
            raise asyncio.TimeoutError("prefill does not answer")
        req = LocalReply(encode(msg))
        await self.prefill.reclaims.on_reclaim(req)
        return RECLAIM_ACK.decode(await asyncio.wait_for(req.answer, timeout))

    async def anomaly(self, ev) -> None:
        pass

    # ---- prefill's peers ------------------------------------------------------------
    async def claim(self, decode, c, timeout) -> ClaimReply:
        if self.claim_gate is not None:
            await self.claim_gate()
        return CLAIM_REPLY.decode(await self.decode.on_claim(c))

    async def prefill_done(self, decode, done, timeout) -> None:
        self.dones.append(done)
        await self.decode.on_prefill_done(done)
