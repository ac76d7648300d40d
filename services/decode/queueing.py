"""A PD submission's acknowledgement does not wait long for the job queue.

When the NATS node leading the job stream dies, a publish is answered only once the
survivors elect a new leader (~10 s on a 3-node cluster), longer than a gateway waits for
a SubmitAck (its submit_timeout_s): an unacknowledged submission is aborted by the gateway
and the request is lost, a migrating one included. So the job is queued in a task, and
the acknowledgement waits for it at most `wait_s`; a job not yet queued goes on being
queued after it (or the request falls back to a local prefill, as on any failed queueing).
While such a job is still pending, the stream is known not to answer and the next
submissions do not wait at all: they would only wait out the same election (a burst:
every request migrating after the node's death)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger("pdmesh.decode")


class JobQueueing:
    def __init__(self):
        self.pending: set[asyncio.Task] = set()   # jobs still being queued after their ack

    def __len__(self) -> int:
        return len(self.pending)

    async def within(self, rid: str, queue: Awaitable[None], wait_s: float) -> bool:
        """Run `queue` (which never raises: it falls back itself); True once it is done,
        False when wait_s passed first (or another job is pending): it goes on then."""
        task = asyncio.ensure_future(queue)
        done, _ = await asyncio.wait({task}, timeout=0.0 if self.pending else wait_s)
        if done:
            return True
        log.info("%s: the job queue has not taken the prefill job (a leader election?); "
                 "acknowledging, still queueing", rid)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return False
