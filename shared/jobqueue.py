"""The prefill job queue: a JetStream work-queue stream, so a job whose prefill worker
dies (stops acking) is redelivered to another worker instead of being lost.

- Replicated: three replicas when the server is part of a cluster (`pdmesh up
  --nats-cluster 3`, compose), one otherwise; a node can die without losing a job.
- Bounded: at most MAX_MSGS jobs, MAX_BYTES bytes, MAX_MSG_SIZE per job; a full queue
  refuses new jobs (discard new) instead of silently dropping queued ones.
- Provisioned, not made by the services: the stream belongs to the admin identity
  (shared/jobstream.py, kept by pdmesh/deploy/streamkeeper.py), which re-creates it within
  seconds when its store is lost; `publish_job` keeps trying meanwhile, deduplicated by a
  message id so a retry after a lost ack never queues a job twice; `JobPuller.fetch`
  re-creates a lost consumer under a prefill worker (prefill owns its durable consumer).

    ack = await publish_job(js, encode(job))                      # decode
    puller = await pull_subscription(js, ack_wait_s, max_deliver, max_jobs)   # prefill
    msgs = await puller.fetch(1, timeout=1.0)
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, PubAck
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from shared import subjects
from shared.jobstream import wait_stream

log = logging.getLogger("pdmesh.jobqueue")

PUBLISH_RETRY_S = 20.0           # publish_job keeps trying this long (leader elections)
REPAIR_EVERY_S = 1.0             # JobPuller: at most one repair per second
CHECK_IDLE_S = 5.0               # JobPuller: idle this long -> check the consumer is there
UNAVAILABLE_S = 3.0              # JobPuller: 503s this long -> repair (sooner: an election)


def consumer_config(ack_wait_s: float, max_deliver: int, max_ack_pending: int) -> ConsumerConfig:
    return ConsumerConfig(durable_name=subjects.PREFILL_CONSUMER, ack_policy=AckPolicy.EXPLICIT,
                          ack_wait=ack_wait_s, max_deliver=max_deliver,
                          max_ack_pending=max_ack_pending)


FIRST_TRY_S = 1.0                # publish_job's first wait for a PubAck; doubled per try


async def publish_job(js: JetStreamContext, data: bytes, *, timeout: float = 5.0,
                      retry_s: float = PUBLISH_RETRY_S, msg_id: str | None = None,
                      first_try_s: float = FIRST_TRY_S) -> PubAck:
    """Queue one prefill job. No stream (its store was lost: the admin re-creates it) or
    no answer (a node died, a leader election): publish again. Every try carries the same
    Nats-Msg-Id, so the stream keeps one copy however many tries reached it. A try waits
    first_try_s for its PubAck, each next one twice as long up to `timeout`: an ack lost
    with a node (its job stored, its answer gone) costs one short wait, not a long one (a
    job queued as a NATS node died waited 11 s for its prefill). Raises the last error
    after retry_s; a full queue (a limit hit) raises at once."""
    headers = {"Nats-Msg-Id": msg_id or uuid.uuid4().hex}
    deadline = time.monotonic() + retry_s
    wait = min(first_try_s, timeout)
    while True:
        try:
            return await js.publish(subjects.prefill_jobs(), data, timeout=wait,
                                    headers=headers)
        except (NoStreamResponseError, NotFoundError, nats.errors.NoRespondersError) as e:
            if time.monotonic() > deadline:
                raise
            log.warning("no job stream answered (%s): trying again", type(e).__name__)
        except (nats.errors.TimeoutError, asyncio.TimeoutError,
                nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError) as e:
            if time.monotonic() > deadline:
                raise
            log.info("no PubAck for a job in %.1f s (%s): publishing it again", wait,
                     type(e).__name__)
            wait = min(wait * 2, timeout)
        except APIError as e:
            if e.code != 503 or time.monotonic() > deadline:   # 503: no quorum right now
                raise
        await asyncio.sleep(0.2)


class JobPuller:
    """A pull subscription on the job queue that repairs itself: a fetch that fails for
    anything but "no job yet" or a short spell of 503s (a leader election), or a long idle
    spell, checks the durable consumer and re-creates it when it is missing (once the
    admin has the stream back).
    fetch/unsubscribe as nats-py's."""

    def __init__(self, js: JetStreamContext, sub, consumer: ConsumerConfig):
        self.js, self.sub, self.consumer = js, sub, consumer
        self.repairs = 0
        self._last_repair = 0.0
        self._last_ok = time.monotonic()

    async def fetch(self, batch: int = 1, timeout: float | None = 5.0):
        try:
            msgs = await self.sub.fetch(batch, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            if time.monotonic() - self._last_ok > CHECK_IDLE_S:
                self._last_ok = time.monotonic()
                await self.repair(check=True)
            raise
        except ServiceUnavailableError:
            # no responder: a leader election (the consumer is there; a repair then only
            # waited its 2-4 s of timeouts before the next fetch), or a lost consumer,
            # repaired once the 503s last UNAVAILABLE_S
            if time.monotonic() - self._last_ok > UNAVAILABLE_S:
                await self.repair()
            raise
        except Exception:
            await self.repair()
            raise
        self._last_ok = time.monotonic()
        return msgs

    async def repair(self, check: bool = False) -> bool:
        """Re-create the consumer if it is missing; True when it did."""
        now = time.monotonic()
        if now - self._last_repair < REPAIR_EVERY_S:
            return False
        self._last_repair = now
        try:
            if check:
                await self.js.consumer_info(subjects.PREFILL_STREAM, subjects.PREFILL_CONSUMER,
                                            timeout=2.0)
                return False
        except NotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - server away: the next fetch tells
            log.debug("consumer check failed: %r", e)
            return False
        try:
            await wait_stream(self.js, wait_s=2.0)
            await self.js.add_consumer(subjects.PREFILL_STREAM, self.consumer, timeout=2.0)
        except Exception as e:  # noqa: BLE001 - try again on the next failure
            log.debug("job queue repair failed: %r", e)
            return False
        self.repairs += 1
        log.warning("job queue: consumer re-created")
        return True

    async def unsubscribe(self) -> None:
        await self.sub.unsubscribe()


async def keep_in_progress(msg, every_s: float) -> None:
    """Tell JetStream a job is still being worked on, every every_s until cancelled, so
    it is redelivered only if the worker dies."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await msg.in_progress()
        except Exception:  # noqa: BLE001 - the next one may get through
            pass


async def pull_subscription(js: JetStreamContext, ack_wait_s: float, max_deliver: int,
                            max_ack_pending: int) -> JobPuller:
    await wait_stream(js)
    consumer = consumer_config(ack_wait_s, max_deliver, max_ack_pending * 64)
    sub = await js.pull_subscribe(subjects.prefill_jobs(), durable=subjects.PREFILL_CONSUMER,
                                  stream=subjects.PREFILL_STREAM, config=consumer)
    return JobPuller(js, sub, consumer)
