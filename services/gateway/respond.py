"""TokenChunks of one dispatched request -> the HTTP answer: one JSON body, or SSE.

Whatever way the answer ends before decode finished the request (client gone, timeout,
instance lost, gateway shutdown, a write that fails), decode is told to abort it.

With tools on (Options.tool_calls), the output is parsed into OpenAI tool calls
(shared.toolcalls): a whole answer gets message.tool_calls (content None when the output is
only calls); a stream gets `delta.tool_calls` (each call whole when its close tag arrives).
Either way finish_reason is "tool_calls" when there is at least one call.

Re-dispatch (invariant 5) happens in one place, next_chunk(): when decode aborts the
request for a speculative-acceptance anomaly and nothing of it has reached the client (a
whole answer: always; a stream: no delta after the role chunk), the request goes to
another decode instance and the answer starts afresh. Once a stream has sent content it
cannot be restarted without the client seeing a splice of two generations, so it ends
with an SSE error event (code anomaly_detected) that tells the client to retry.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from shared.contracts.common import ErrorCode
from shared.contracts.messages import FinishReason, TokenChunk
from shared.toolcalls import openai_deltas, parse_for, stream_for

from . import access, protocol as P
from .aborting import AbortOnExit, fail_stream
from .chunks import Lost
from .dispatch import DecodeClient, Dispatch
from .metrics import Metrics
from .migrate import migrate
from .protocol import OpenAIError, chunk_error
from .slowclients import sse_response
from .validate import Prepared

log = logging.getLogger("pdmesh.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class Answer:
    """What has come back so far: text, token counts, logprobs, finish; feeds the metrics.
    restart() forgets it all for a re-dispatch."""

    def __init__(self, prep: Prepared, d: Dispatch, arrival: float, metrics: Metrics,
                 token_text: Callable[[int], str], rid: str):
        self.prep, self.arrival, self.metrics = prep, arrival, metrics
        self.token_text, self.rid = token_text, rid
        self.sent = False           # a stream wrote output to the client: no restart
        self._last_token_at: float | None = None
        self.ttft_s: float | None = None    # arrival to the first token (the access log)
        self.restart(d)

    def resume(self, d: Dispatch) -> None:
        """Go on from dispatch d, which continues after the tokens received so far."""
        self.d = d
        self.base = len(self.token_ids)

    def restart(self, d: Dispatch) -> None:
        """Serve the request from dispatch d, from its first token."""
        self.d = d
        self.base = 0               # tokens received before d (d's prompt ends with them)
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_tokens = len(self.prep.prompt_ids)
        self.counted = 0            # tokens received
        self.reported = 0           # decode's cumulative count, when it sends one
        self.cached_tokens = 0      # prompt tokens served from a prefix cache
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.chat_lp: list[dict] = []
        self.cmpl_lp: dict | None = None
        self.lp_offset = 0          # completions logprobs text_offset
        self.spec = (0, 0, 0)       # speculative steps, drafts proposed, drafts accepted
        o = self.prep.options
        self.parser = (stream_for(self.prep.constraint, self.rid)
                       if o.stream and o.chat and o.tool_calls
                       else None)

    def add(self, chunk: TokenChunk) -> tuple[str, dict | None]:
        """Account one chunk; returns (new text, its logprobs in the wire format or None).
        Raises OpenAIError when the chunk carries an error or an abort."""
        if chunk.finished:
            self.d.finished = True
        if chunk.error is not None:
            raise chunk_error(chunk.error, self.d.instance)
        if chunk.finished and chunk.finish_reason not in (FinishReason.STOP,
                                                          FinishReason.LENGTH):
            raise OpenAIError(503, f"decode instance {self.d.instance} ended the request with "
                                   f"finish_reason={chunk.finish_reason!r}", code="aborted")
        self._time(len(chunk.token_ids))
        self.counted += len(chunk.token_ids)
        if chunk.completion_tokens:
            self.reported = max(self.reported, self.base + chunk.completion_tokens)
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens - self.base
        self.cached_tokens = min(max(self.cached_tokens, chunk.cached_tokens), self.prompt_tokens)
        if chunk.spec_steps:
            self.spec = (chunk.spec_steps, chunk.spec_proposed, chunk.spec_accepted)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
            self.metrics.cached_tokens.inc(self.cached_tokens)
            self.metrics.vllm.finished(self.prompt_tokens, self.base + self.counted,
                                       self.cached_tokens,
                                       getattr(chunk.finish_reason, "value", chunk.finish_reason),
                                       time.monotonic() - self.arrival)
            self.metrics.vllm.phased(chunk.queue_s, chunk.prefill_s, chunk.decode_s)
            if self.spec[0]:
                self.metrics.spec_accept_length.observe(P.spec_usage(*self.spec)
                                                        ["spec_accept_length"])
        self.parts.append(chunk.text)
        self.token_ids += chunk.token_ids
        return chunk.text, self._logprobs(chunk)

    def _time(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            self.ttft_s = now - self.arrival
            self.metrics.ttft.observe(self.ttft_s)
            self.metrics.vllm.ttft.observe(self.ttft_s)
        else:
            self.metrics.itl.observe((now - self._last_token_at) / n, n)
            self.metrics.vllm.itl.observe((now - self._last_token_at) / n, n)
        self._last_token_at = now

    def _logprobs(self, chunk: TokenChunk) -> dict | None:
        if not self.prep.options.logprobs or not chunk.logprobs:
            return None
        if self.prep.options.chat:
            lp = P.chat_logprobs(chunk.logprobs, self.token_text)
            self.chat_lp += lp["content"]
            return lp
        lp = P.completion_logprobs(chunk.logprobs, self.token_text, self.lp_offset)
        self.lp_offset += sum(len(t) for t in lp["tokens"])
        self.cmpl_lp = P.merge_completion_logprobs(self.cmpl_lp, lp)
        return lp

    @property
    def usage(self) -> dict:
        u = P.usage(self.prompt_tokens, self.reported or self.counted, self.cached_tokens)
        return u | P.spec_usage(*self.spec) if self.spec[0] else u

    def all_logprobs(self) -> dict | None:
        if not self.prep.options.logprobs:
            return None
        if self.prep.options.chat:
            return {"content": self.chat_lp, "refusal": None}
        return self.cmpl_lp or P.completion_logprobs([], self.token_text, 0)


async def next_chunk(client: DecodeClient, ans: Answer, deadline: float,
                     gone: Callable[[], bool]) -> TokenChunk:
    """The request's next chunk. An anomaly abort re-dispatches the request while nothing
    reached the client (and DecodeClient.redispatch finds an instance and has attempts
    left); otherwise the error chunk is returned, for Answer.add to raise."""
    while True:
        try:
            c = await client.next_chunk(ans.d, deadline, gone)
        except Lost as e:
            nd = await migrate(client, ans.d, ans.token_ids, e.reason)
            if nd is None:
                raise
            log.warning("%s: %s; migrated to %s after %d tokens", ans.rid, e.message,
                        nd.instance, len(ans.token_ids))
            ans.metrics.migrations.inc(reason=e.reason)
            ans.resume(nd)
            continue
        if c.error is None or c.error.code is not ErrorCode.ANOMALY:
            return c
        ans.metrics.anomaly_aborts.inc(rule=c.anomaly_rule or "unknown")
        ans.d.finished = True                   # decode ended it: no abort to send
        loop = c.anomaly_rule == REPETITION
        nd = None if ans.sent else await client.redispatch(ans.d, fresh_sample=loop)
        if nd is None:
            # a loop is the model's output, not wrong state: what came before it stands,
            # cut short (finish_reason "length", stop_reason "repetition")
            return cut_short(c) if loop else c
        log.info("%s: anomaly (%s) on %s; re-dispatched to %s", ans.rid, c.anomaly_rule,
                 ans.d.instance, nd.instance)
        ans.metrics.redispatches.inc()
        client.release(ans.d)
        ans.restart(nd)


REPETITION = "repetition"      # services/decode/monitor.py's Rule.REPETITION


def cut_short(c: TokenChunk) -> TokenChunk:
    """The final chunk of an answer decode cut for a repetition loop."""
    return msgspec.structs.replace(c, error=None, finished=True,
                                   finish_reason=FinishReason.LENGTH, stop_reason=REPETITION)


async def answer(request: web.Request, client: DecodeClient, d: Dispatch, prep: Prepared,
                 rid: str, arrival: float, metrics: Metrics,
                 token_text: Callable[[int], str]) -> web.StreamResponse:
    deadline = arrival + client.request_timeout_s
    ans = Answer(prep, d, arrival, metrics, token_text, rid)
    access.note(request, [ans])
    async with AbortOnExit(client, metrics, [ans]):
        if prep.options.stream:
            return await _stream(request, client, ans, rid, deadline)
        return await _complete(request, client, ans, rid, deadline)


def client_gone(request: web.Request) -> Callable[[], bool]:
    def gone() -> bool:
        tr = request.transport
        return tr is None or tr.is_closing()
    return gone


async def _complete(request, client, ans: Answer, rid, deadline) -> web.Response:
    gone = client_gone(request)
    while not ans.d.finished:
        ans.add(await next_chunk(client, ans, deadline, gone))
    d = ans.d
    body = whole_body(ans, rid, int(time.time()))
    return web.Response(body=P.dumps(body), content_type="application/json",
                        headers={"x-pdmesh-path": d.path.value, "x-pdmesh-decode": d.instance})


def whole_body(ans: Answer, rid: str, created: int) -> dict:
    """A finished answer's JSON body (one choice, index 0)."""
    o = ans.prep.options
    text = "".join(ans.parts)
    if o.chat and o.tool_calls:
        content, calls = parse_for(ans.prep.constraint, text, ans.rid)
        finish = FinishReason.TOOL_CALLS.value if calls else ans.finish_reason
        body = P.chat_completion(rid, created, o.model, content, finish, ans.usage,
                                 ans.all_logprobs(), tool_calls=calls)
    else:
        build = P.chat_completion if o.chat else P.completion
        body = build(rid, created, o.model, text, ans.finish_reason, ans.usage,
                     ans.all_logprobs())
    if o.return_token_ids:
        body["choices"][0]["token_ids"] = ans.token_ids
    if ans.stop_reason == REPETITION:      # vLLM's stop_reason field, for why it was cut
        body["choices"][0]["stop_reason"] = REPETITION
    return body


async def _stream(request, client, ans: Answer, rid, deadline) -> web.StreamResponse:
    d = ans.d
    created = int(time.time())
    resp = sse_response(request, SSE_HEADERS | {"x-pdmesh-path": d.path.value,
                                                "x-pdmesh-decode": d.instance})
    await resp.prepare(request)
    sse = SseStream(resp, ans, rid, created)
    try:
        await sse.relay(client, deadline, client_gone(request))
    except OpenAIError as e:
        # headers are gone: the error travels as an SSE event, then [DONE]
        await fail_stream(client, ans.metrics, ans.d, e)
        await resp.write(P.sse(e.body()))
    await resp.write(P.SSE_DONE)
    await resp.write_eof()
    return resp


class SseStream:
    """One streamed answer's chunks, written to its response. Only content deltas mark
    the answer as sent (the role chunk does not: a re-dispatch is still possible).
    index: the choice's (n > 1, choices.py); own_usage: whether it ends with its own
    usage chunk (a choice does not: the request's, over every choice, ends the stream)."""

    def __init__(self, resp: web.StreamResponse, ans: Answer, rid: str, created: int,
                 index: int = 0, own_usage: bool = True):
        self.resp, self.ans, self.rid, self.created = resp, ans, rid, created
        self.index, self.own_usage = index, own_usage
        self.o = ans.prep.options

    async def relay(self, client, deadline: float, gone: Callable[[], bool]) -> None:
        """Role chunk, every delta as it comes, the finish chunk, the usage chunk."""
        o, ans = self.o, self.ans
        if o.chat:
            await self.resp.write(self.chunk("", role=True))
        while not ans.d.finished:
            c = await next_chunk(client, ans, deadline, gone)
            text, lp = ans.add(c)
            if ans.parser is not None:
                await self.write_deltas(openai_deltas(ans.parser.feed(text)) if text else [], lp,
                                        c.token_ids if o.return_token_ids else None)
            elif text or lp or (o.return_token_ids and c.token_ids):
                await self.write(self.chunk(text, lp=lp, ids=c.token_ids))
        finish = ans.finish_reason
        if ans.parser is not None:
            await self.write_deltas(openai_deltas(ans.parser.finish()), None, None)
            if ans.parser.has_tool_calls:
                finish = FinishReason.TOOL_CALLS.value
        await self.resp.write(self.chunk("", finish=finish, stop_reason=ans.stop_reason))
        if o.include_usage and self.own_usage:
            await self.resp.write(P.sse(P.usage_chunk(self.rid, self.created, o.model, o.chat,
                                                      ans.usage)))

    def chunk(self, text: str, finish: str | None = None, lp: dict | None = None,
              role: bool = False, ids: list[int] | None = None,
              stop_reason: str | int | None = None) -> bytes:
        o = self.o
        if o.chat:
            delta = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or lp else {})
            body = P.chat_chunk(self.rid, self.created, o.model, delta, finish, lp,
                                o.include_usage)
        else:
            body = P.completion_chunk(self.rid, self.created, o.model, text, finish, lp,
                                      o.include_usage)
        body["choices"][0]["index"] = self.index
        if o.return_token_ids and ids:
            body["choices"][0]["token_ids"] = ids
        if stop_reason == REPETITION:
            body["choices"][0]["stop_reason"] = REPETITION
        return P.sse(body)

    async def write(self, data: bytes) -> None:
        self.ans.sent = True
        await self.resp.write(data)

    async def write_deltas(self, deltas: list[dict], lp: dict | None,
                           ids: list[int] | None) -> None:
        """Parser deltas, one chunk each; a TokenChunk's logprobs / token ids ride on the
        first (or on an empty delta while the parser holds its text back)."""
        if not deltas and (lp or ids):
            deltas = [{}]
        for k, delta in enumerate(deltas):
            body = P.chat_chunk(self.rid, self.created, self.o.model, delta, None,
                                lp if k == 0 else None, self.o.include_usage)
            body["choices"][0]["index"] = self.index
            if ids and k == 0:
                body["choices"][0]["token_ids"] = ids
            await self.write(P.sse(body))
