"""Whatever way an HTTP answer ends before decode finished its request (client gone, an
error, a timeout, gateway shutdown), decode is told to abort it: one exit path for the
chat/completions answer (respond), its n > 1 choices (choices) and the Responses and
Messages APIs (apis.common).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.contracts.messages import AbortReason

from .chunks import ClientGone
from .dispatch import DecodeClient
from .metrics import Metrics
from .protocol import OpenAIError

if TYPE_CHECKING:
    from .respond import Answer


async def close(client: DecodeClient, answers: Sequence[Answer], reason: str) -> None:
    """Abort each answer's current dispatch (a no-op when decode finished it), release it."""
    for ans in answers:
        await client.abort(ans.d, reason)
        client.release(ans.d)


async def fail_stream(client: DecodeClient, metrics: Metrics, d, e: OpenAIError) -> None:
    """An error after an SSE answer's headers went out (it travels as an event): counted by
    its code, and dispatch d aborted with it."""
    code = e.code or "error"
    metrics.failures.inc(code=code)
    await client.abort(d, code)


class AbortOnExit:
    """`async with AbortOnExit(client, metrics, answers):` around an answer. On exit a
    failure is counted (an OpenAIError by its code, a client gone as "client_gone"), then
    the answers are closed with the error's code as the reason, else "client". `answers`
    is read on exit: a re-dispatch (ans.d) or a choice dispatched later is included."""

    def __init__(self, client: DecodeClient, metrics: Metrics, answers: Sequence[Answer]):
        self.client, self.metrics, self.answers = client, metrics, answers

    async def __aenter__(self) -> AbortOnExit:
        return self

    async def __aexit__(self, et, e, tb) -> bool:
        reason = AbortReason.CLIENT.value
        if isinstance(e, OpenAIError):
            reason = e.code or "error"
            self.metrics.failures.inc(code=reason)
        elif isinstance(e, (ClientGone, ConnectionError, asyncio.CancelledError)):
            self.metrics.failures.inc(code="client_gone")
        await close(self.client, self.answers, reason)
        return False
