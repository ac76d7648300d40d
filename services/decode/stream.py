"""Decode's outputs: every engine output becomes a TokenChunk for the request's gateway,
sequenced per request (seq 0, 1, ...). With speculative decoding on, every output first
feeds the anomaly monitor (monitor.py, invariant 5): a request it flags is aborted like
any other, its tokens are never sent, the gateway gets an ANOMALY error chunk (and
re-dispatches the request elsewhere), and an AnomalyEvent goes out."""
from __future__ import annotations

import logging
import time

from shared.contracts.common import ErrorCode, ErrorReply
from shared.contracts.messages import AbortReason, AnomalyEvent, FinishReason, Path, TokenChunk
from shared.engine.output import RequestOutput

from .lifecycle import RequestTable
from .monitor import AnomalyMonitor, Rule
from .peers import DecodePeers
from .reclaim import Reclaimer
from .request import DecodeRequest

log = logging.getLogger("pdmesh.decode")


class TokenStream:
    def __init__(self, iid: str, table: RequestTable, peers: DecodePeers,
                 reclaimer: Reclaimer, monitor: AnomalyMonitor | None,
                 prompt_done=lambda rid: None):
        """prompt_done(rid): a prompt decode computed itself (colocated) is complete."""
        self.prompt_done = prompt_done
        self.iid = iid
        self.table = table
        self.peers = peers
        self.reclaimer = reclaimer
        self.monitor = monitor

    async def publish_all(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            await self.publish(o)

    async def publish(self, o: RequestOutput) -> None:
        r = self.table.get(o.request_id)
        if r is None or not r.live:
            return
        if self.monitor is not None:
            rule = (self.monitor.observe_tokens(o.request_id, o.new_token_ids)
                    or self.monitor.observe_totals(o.request_id, o.spec_steps, o.spec_proposed,
                                                   o.spec_accepted, o.num_output_tokens))
            if rule is not None:   # this output's tokens are not sent: they are suspect
                await self.on_anomaly(o, rule)
                return
        chunk = TokenChunk(request_id=o.request_id, token_ids=o.new_token_ids, text=o.text,
                           logprobs=o.logprobs, finished=o.finished,
                           finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                           prompt_tokens=o.num_prompt_tokens,
                           completion_tokens=o.num_output_tokens, path=r.path, seq=r.chunks,
                           cached_tokens=cached_tokens(o, r),
                           spec_steps=o.spec_steps, spec_proposed=o.spec_proposed,
                           spec_accepted=o.spec_accepted,
                           **(phases(o, r, time.monotonic()) if o.finished else {}))
        if r.chunks == 0 and r.path is Path.COLOCATED:
            self.prompt_done(o.request_id)
        if r.chunks == 0:
            r.first_token = time.monotonic()
        r.chunks += 1
        if o.finished:
            self.table.finish(o.request_id)
            if self.monitor is not None:
                self.monitor.forget(o.request_id)
            self.reclaimer.forget(o.request_id)     # per-request state elsewhere (trace spans)
        await self._send(r.reply_subject, chunk)

    async def fail(self, rid: str, code: ErrorCode, message: str, reason,
                   rule: str = "") -> None:
        """Abort the request and tell its gateway why (a final error chunk)."""
        r = self.reclaimer.abort(rid, reason)
        if r is not None:
            err = ErrorReply(code=code, message=message, request_id=rid)
            await self._send(r.reply_subject, TokenChunk(
                request_id=rid, finished=True, finish_reason=FinishReason.ABORT, error=err,
                path=r.path, seq=r.chunks, anomaly_rule=rule))

    async def fail_running(self, code: ErrorCode, message: str, reason) -> None:
        for r in list(self.table.live()):
            if not r.wants_kv:
                await self.fail(r.request_id, code, message, reason)

    async def on_anomaly(self, o: RequestOutput, rule: str) -> None:
        """Invariant 5: abort like any other (reclaim applies) with an ANOMALY error the
        gateway acts on, then tell whoever listens."""
        st = self.monitor.stats(o.request_id)
        ev = AnomalyEvent(request_id=o.request_id, instance_id=self.iid, rule=rule,
                          accept_length=round(st.accept_length, 4),
                          accept_rate=round(st.accept_rate, 4),
                          generated_tokens=o.num_output_tokens, ts=time.time())
        log.warning("%s: anomaly %s (accept length %.2f, accept rate %.3f, %d tokens); "
                    "aborting", o.request_id, rule, ev.accept_length, ev.accept_rate,
                    ev.generated_tokens)
        if rule == Rule.REPETITION:
            why = (f"repetition: the last {len(st.tail)} tokens repeat a {st.period}-token "
                   f"span after {ev.generated_tokens} tokens")
        else:
            why = (f"speculative decoding acceptance anomaly ({rule}: accept length "
                   f"{ev.accept_length:.2f}, accept rate {ev.accept_rate:.3f} after "
                   f"{ev.generated_tokens} tokens); the output is discarded")
        await self.fail(o.request_id, ErrorCode.ANOMALY, why, reason=AbortReason.ANOMALY,
                        rule=rule)
        try:
            await self.peers.anomaly(ev)
        except Exception as e:  # noqa: BLE001 - the request is handled; only the event is lost
            log.warning("%s: cannot publish the anomaly event: %s", o.request_id, e)

    async def _send(self, subject: str, chunk: TokenChunk) -> None:
        try:
            await self.peers.send_chunk(subject, chunk)
        except Exception as e:  # noqa: BLE001 - gateway notices via its own timeouts
            log.warning("%s: cannot publish tokens: %s", chunk.request_id, e)


def phases(o: RequestOutput, r: DecodeRequest, now: float) -> dict[str, float]:
    """vLLM's request phases, seconds (the final chunk's queue_s, prefill_s, decode_s):
    accepted here -> its prompt began (PD: the first granted claim; colocated: its first
    engine step) -> its first chunk -> now."""
    first = r.first_token or now
    began = min(r.began or o.scheduled_at or first, first)
    return {"queue_s": max(0.0, began - r.submitted), "prefill_s": max(0.0, first - began),
            "decode_s": max(0.0, now - first)}


def cached_tokens(o: RequestOutput, r: DecodeRequest) -> int:
    """Prompt tokens not computed: prefill's count on the PD path (decode's own hits only
    spare transfer), the engine's when it prefilled here. Final chunk only."""
    if not o.finished:
        return 0
    return r.cached_tokens if r.path is Path.PD else o.num_cached_tokens
