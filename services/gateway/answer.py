"""One dispatched request's answer as typed events, whatever API renders it.

  Answer      what has come back so far (text, token counts, logprobs, finish, the tool
              parse); feeds the metrics; restart() forgets it all for a re-dispatch
  next_chunk  the request's next TokenChunk: a lost instance migrates the request, an
              anomaly abort re-dispatches it while nothing reached the client (invariant 5)
  events      the answer's events, in output order: `Piece` (content text with its
              chunk's logprobs and token ids), `Call` (a whole tool call, parsed once, by
              shared.toolcalls' stream parser: the whole answer is the stream fed at once),
              then one `Finish`; errors are raised (OpenAIError)

Each API renders the events its own way: chat and completions (respond.py; n > 1 merges
its choices' event streams, choices.py), Responses and Messages (apis/).

Once a stream has shown content it cannot be restarted without the client seeing a splice
of two generations: `events(stream=True)` marks the answer `sent` as it yields the first
event a renderer writes, and an anomaly after that ends the stream with an error event
(code anomaly_detected) that tells the client to retry; a repetition loop ends it cut short.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from shared.contracts.common import ErrorCode
from shared.contracts.messages import FinishReason, TokenChunk
from shared.toolcalls import Call, Text, stream_for

from . import protocol as P
from .chunks import Lost
from .dispatch import DecodeClient, Dispatch
from .metrics import Metrics
from .migrate import migrate
from .protocol import OpenAIError, chunk_error
from .validate import Prepared

log = logging.getLogger("pdmesh.gateway")


@dataclass(frozen=True, slots=True)
class Piece:
    """Content text ("" when a chunk's text is all held back or all calls), with the
    logprobs (the API's wire format) and token ids of the chunk it opens."""
    text: str
    logprobs: dict | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Finish:
    """The answer ended: stop | length | tool_calls; stop_reason as vLLM's (the matched
    stop string or token, or "repetition" for a loop cut short)."""
    reason: str | None
    stop_reason: str | int | None = None


Event = Piece | Call | Finish


def shown(e: Event, return_token_ids: bool) -> bool:
    """Whether a renderer writes e: a Piece with text, logprobs or (when asked for) token
    ids, any Call; the Finish is written but shows no content."""
    if isinstance(e, Piece):
        return bool(e.text or e.logprobs or (return_token_ids and e.token_ids))
    return isinstance(e, Call)


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
        self.content: list[str] = []    # the parsed output: its content text ...
        self.calls: list[Call] = []     # ... and its tool calls (tools on)
        self.end: Finish | None = None  # set with the last event
        self.parser = (stream_for(self.prep.constraint, self.rid)
                       if self.prep.options.tool_calls else None)

    def parse(self, text: str, lp: dict | None, ids: list[int]) -> list[Event]:
        """One chunk's new text -> its events: a Piece (the content up to its first call,
        with the chunk's logprobs and token ids) first, always, then calls and later text."""
        if self.parser is None:
            evs: list[Text | Call] = [Text(text)] if text else []
        else:
            evs = self.parser.feed(text) if text else []
        lead = evs.pop(0).text if evs and isinstance(evs[0], Text) else ""
        self.content.append(lead)
        return [Piece(lead, lp, ids)] + [self._keep(e) for e in evs]

    def parse_end(self) -> list[Event]:
        """What the parser held back (an unclosed block, trailing whitespace), then Finish."""
        evs = [self._keep(e) for e in (self.parser.finish() if self.parser else [])]
        finish = FinishReason.TOOL_CALLS.value if self.calls else self.finish_reason
        self.end = Finish(finish, self.stop_reason)
        return evs + [self.end]

    def _keep(self, e: Text | Call) -> Event:
        if isinstance(e, Call):
            self.calls.append(e)
            return e
        self.content.append(e.text)
        return Piece(e.text)

    def shows(self, e: Event) -> bool:
        """Whether a renderer writes e (what makes a streamed answer `sent`)."""
        return shown(e, self.prep.options.return_token_ids)

    @property
    def text(self) -> str:
        """The content (every Piece's text: the output less its tool calls)."""
        return "".join(self.content)

    def message(self) -> tuple[str | None, list[Call]]:
        """The whole answer as a message: (content, tool calls); content is None when the
        answer is only calls."""
        return ((self.text or None) if self.calls else self.text), self.calls

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


async def events(client: DecodeClient, ans: Answer, deadline: float,
                 gone: Callable[[], bool], stream: bool) -> AsyncIterator[Event]:
    """The answer's events, one Piece per TokenChunk at least, then Finish. A re-dispatch
    (only while nothing was shown) restarts the answer, its parse included."""
    while not ans.d.finished:
        c = await next_chunk(client, ans, deadline, gone)
        text, lp = ans.add(c)
        for e in ans.parse(text, lp, c.token_ids):
            if stream and ans.shows(e):
                ans.sent = True
            yield e
    for e in ans.parse_end():
        yield e


async def drain(client: DecodeClient, ans: Answer, deadline: float,
                gone: Callable[[], bool]) -> Answer:
    """A whole answer: its events consumed; ans.text, ans.calls, ans.finish_reason hold it."""
    async for _ in events(client, ans, deadline, gone, stream=False):
        pass
    return ans
