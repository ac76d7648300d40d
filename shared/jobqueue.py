"""The prefill job queue: a JetStream work-queue stream, so a job whose prefill worker
dies (stops acking) is redelivered to another worker instead of being lost."""
from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import subjects

log = logging.getLogger("pdmesh.jobqueue")


async def ensure_stream(js: JetStreamContext) -> None:
    cfg = StreamConfig(name=subjects.PREFILL_STREAM, subjects=[subjects.prefill_jobs()],
                       retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                       max_age=600.0)
    try:
        await js.add_stream(cfg)
    except BadRequestError:  # exists with another config: keep it, it still works
        await js.update_stream(cfg)


async def pull_subscription(js: JetStreamContext, ack_wait_s: float, max_deliver: int,
                            max_ack_pending: int):
    await ensure_stream(js)
    return await js.pull_subscribe(
        subjects.prefill_jobs(), durable=subjects.PREFILL_CONSUMER,
        stream=subjects.PREFILL_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                              max_deliver=max_deliver, max_ack_pending=max_ack_pending * 64))
