"""Asking instead of waiting. A request that has heard nothing from its decode instance for
probe_after_s asks the instance how many of its TokenChunks it has sent (ProgressQuery on
decode_progress). More than arrived, or a request the instance no longer serves (it ended
it, or never had it), means chunks were lost on the way: a NATS node, a route or this
gateway's own connection was cut while they travelled. The request is Lost at once and
migrates, instead of waiting out progress_timeout_s (60 s) or, before its first token,
first_chunk_timeout_s (600 s: a long prompt's prefill). An instance that answers with what
arrived is still working (prefilling, or queued): the request keeps waiting. No answer
(an unreachable or older instance) decides nothing; the heartbeat and the timeouts do.

A chunk and the answer travel on different subscriptions, so the answer can overtake a
chunk sent just before it: DecodeClient judges an answer only after the next tick's wait
for chunks, and only if no chunk arrived since the question was asked."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import nats.errors

from shared import subjects
from shared.contracts.common import Codec, ContractError, encode
from shared.contracts.messages import ProgressQuery, ProgressReply
from shared.service import ServiceError, decode_reply

REPLY = Codec(ProgressReply)


@dataclass(slots=True)
class Probe:
    asked_at: float             # when the question went out
    sent: int | None = None     # the instance's answer; None: none came


def due(p: Probe | None, progress_at: float, now: float, after_s: float) -> bool:
    """Ask now? The request has been silent after_s, and the last question is that old."""
    if now - progress_at < after_s:
        return False
    return p is None or now - p.asked_at >= after_s


def verdict(p: Probe | None, progress_at: float, received: int) -> str | None:
    """Why the request's chunks are lost, from an answer nothing has contradicted; or None."""
    if p is None or p.sent is None or progress_at >= p.asked_at:
        return None                      # no answer, or a chunk came since the question
    if p.sent < 0:
        return "is no longer serving this request, whose last chunks never arrived"
    if p.sent > received:
        return f"sent {p.sent} chunks of this request; {received} arrived"
    return None


async def ask(nc, instance: str, request_id: str, clock: Callable[[], float],
              timeout_s: float) -> Probe:
    """One question to the instance; a Probe without an answer when none came."""
    p = Probe(asked_at=clock())
    try:
        reply = await nc.request(subjects.decode_progress(instance),
                                 encode(ProgressQuery(request_id=request_id)),
                                 timeout=timeout_s)
        p.sent = decode_reply(reply.data, reply.headers, REPLY).sent
    except (nats.errors.Error, TimeoutError, ServiceError, ContractError):
        pass
    return p
