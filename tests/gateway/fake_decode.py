"""A decode instance in miniature for gateway tests: heartbeats, the submit endpoint (on the
real ServiceRuntime, so refusals travel as micro errors) and scripted TokenChunks."""
from __future__ import annotations

import asyncio
import uuid

from shared import subjects
from shared.contracts.common import Codec, ErrorCode, ErrorReply, encode
from shared.contracts.messages import Abort, DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk
from shared.service import ServiceError, ServiceRuntime

WORDS = ["Hello", ",", " world", "!"]
TOKENS = [101, 102, 103, 104]


class FakeDecode:
    """mode: "ok" streams WORDS then finishes; "stall" sends one chunk and then nothing;
    "error" sends one chunk and then an error chunk; "slow" sends WORDS * 50, 50 ms apart."""

    def __init__(self, nats_url: str, *, running: int = 0, blocks_free: int = 100,
                 refuse: ErrorCode | None = None, mode: str = "ok", path: Path = Path.COLOCATED,
                 finish_reason: str = "stop", fingerprint: str = ""):
        self.iid = f"decode_fake_{uuid.uuid4().hex[:8]}"
        self.rt = ServiceRuntime("decode", self.iid, nats_url)
        self.running, self.blocks_free = running, blocks_free
        self.refuse, self.mode, self.path = refuse, mode, path
        self.finish_reason = finish_reason
        self.fingerprint = fingerprint
        self.submits: list[DecodeSubmit] = []
        self.aborts: list[Abort] = []
        self.beating = True
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "FakeDecode":
        await self.rt.start()
        await self.rt.endpoint("submit", subjects.decode_submit(self.iid), self._submit,
                               Codec(DecodeSubmit))
        await self.rt.nc.subscribe(subjects.decode_abort(self.iid), cb=self._abort)
        self._tasks.append(asyncio.create_task(self._beat()))
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self._tasks:
            t.cancel()
        await self.rt.close()

    def stop_heartbeats(self) -> None:
        self.beating = False

    async def _beat(self) -> None:
        while self.beating:
            hb = Heartbeat(service="decode", instance_id=self.iid, running=self.running,
                           queue_depth=2, blocks_free=self.blocks_free, blocks_used=7,
                           tokenizer_fingerprint=self.fingerprint)
            await self.rt.nc.publish(subjects.heartbeat("decode"), encode(hb))
            await asyncio.sleep(0.2)

    async def _abort(self, msg) -> None:
        self.aborts.append(Codec(Abort).decode(msg.data))

    async def _submit(self, sub: DecodeSubmit) -> bytes:
        self.submits.append(sub)
        if self.refuse is not None:
            raise ServiceError(self.refuse, f"fake refuses: {self.refuse.value}", sub.request_id)
        self._tasks.append(asyncio.create_task(self._generate(sub)))
        return encode(SubmitAck(request_id=sub.request_id, path=self.path))

    async def _send(self, sub: DecodeSubmit, **kw) -> None:
        chunk = TokenChunk(request_id=sub.request_id, **kw)
        await self.rt.nc.publish(sub.reply_subject, encode(chunk))

    async def _generate(self, sub: DecodeSubmit) -> None:
        words, tokens = (WORDS * 50, TOKENS * 50) if self.mode == "slow" else (WORDS, TOKENS)
        lp = sub.params.logprobs is not None
        for i, (w, t) in enumerate(zip(words, tokens)):
            if any(a.request_id == sub.request_id for a in self.aborts):
                return
            await asyncio.sleep(0.05 if self.mode == "slow" else 0.01)
            await self._send(sub, token_ids=[t], text=w,
                             logprobs=[(t, -0.5, [(t, -0.5), (7, -1.5)])] if lp else [])
            if self.mode == "stall":
                return
            if self.mode == "error":
                await self._send(sub, finished=True, error=ErrorReply(
                    code=ErrorCode.PREFILL_FAILED, message="prefill worker died",
                    request_id=sub.request_id))
                return
        await self._send(sub, finished=True, finish_reason=self.finish_reason,
                         prompt_tokens=len(sub.prompt_ids), completion_tokens=len(tokens))
