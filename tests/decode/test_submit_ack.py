"""A PD submission is acknowledged while the job queue cannot take its job yet. When the
NATS node that leads the job stream dies, a publish is answered only once the survivors
elect a new leader (~10 s measured on a 3-node cluster), longer than the gateway waits for
a SubmitAck (submit_timeout_s, 5 s): decode used to hold the acknowledgement until the job
was queued, so the gateway gave up and aborted the submission, and a request migrating
back to its only decode instance (token chunks lost in the node's death) ended in
instance_lost (tests/e2e/test_nats_cluster.py). Decode and prefill in one process
(tests/decode/local_mesh.py); the queue is held shut by the test."""
from __future__ import annotations

import asyncio

import pytest

from services.decode.request import RequestStatus
from shared.contracts.common import ErrorCode
from shared.service import ServiceError

from .local_mesh import MAX_TOKENS, LocalMesh, until


class ElectingQueue(LocalMesh):
    """queue_job waits for `elected` (a job stream without a leader), then queues the job,
    or fails as a publish that gave up does (`gives_up`)."""

    def __init__(self, *a, gives_up: bool = False, **kw):
        super().__init__(*a, **kw)
        self.elected, self.gives_up = asyncio.Event(), gives_up

    async def queue_job(self, job) -> None:
        await self.elected.wait()
        if self.gives_up:
            raise TimeoutError("no job stream answered")
        await super().queue_job(job)


@pytest.mark.parametrize("gives_up", [False, True], ids=["queued_later", "prefilled_here"])
async def test_a_submission_is_acknowledged_while_the_job_stream_elects_a_leader(
        tiny_target, tiny_prompts, reference, gives_up):
    mesh = ElectingQueue(tiny_target, decode={"job_queue_wait_s": 0.2}, gives_up=gives_up)
    await mesh.start()
    try:
        prompts = {"a": tiny_prompts[5], "b": tiny_prompts[6]}
        ack = await asyncio.wait_for(       # well within the gateway's submit_timeout_s
            mesh.submit("a", prompts["a"], max_tokens=MAX_TOKENS, ignore_eos=True), 3.0)
        assert ack.path.value == "pd" and not mesh.jobs
        assert mesh.decode.table.state("a") is RequestStatus.ALLOCATED
        # the next submission does not wait again while "a"'s job is still waiting
        # (it would only wait out the same election)
        mesh.decode.cfg.job_queue_wait_s = 600.0
        ack = await asyncio.wait_for(
            mesh.submit("b", prompts["b"], max_tokens=MAX_TOKENS, ignore_eos=True), 3.0)
        assert ack.path.value == "pd" and len(mesh.decode.queueing) == 2
        mesh.elected.set()                  # the stream answers: queued, or given up on
        if gives_up:                        # the existing fallback: prefilled here
            for rid, p in prompts.items():
                assert await mesh.tokens(rid, timeout=30) == reference(p)
            assert mesh.decode.stats()["prefill_fallbacks"] == 2
        else:
            await until(lambda: len(mesh.jobs) == 2)
            assert {mesh.decode.table.state(rid) for rid in prompts} == {
                RequestStatus.AWAITING_KV}
            for _ in prompts:
                task, msg = mesh.run_job()
                await task
                assert msg.acked
            for rid, p in prompts.items():
                assert await mesh.tokens(rid, timeout=30) == reference(p)
        assert not mesh.decode.queueing and mesh.decode.stats()["blocks_used"] == 0
    finally:
        await mesh.close()


async def test_an_abort_that_comes_while_the_submission_is_in_hand_ends_it(tiny_target,
                                                                           tiny_prompts):
    """The gateway aborts a submission it gave up waiting for (submit_timeout_s) and tries
    another instance. That abort could come while decode still had the submission in hand,
    before the request was in its table (its cache lookup or its schema's compile took
    that long): it found nothing to abort, and the request was then admitted and generated
    for nobody."""
    mesh = LocalMesh(tiny_target, decode={"kvstore": True})
    mesh.decode.kvc = kvstore = SlowKvstore()
    await mesh.start()
    try:
        prompt = (tiny_prompts[5] * 40)[:40]          # a whole chunk: there is a prefix to look up
        sub = asyncio.ensure_future(
            mesh.submit("a", prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
        await asyncio.wait_for(kvstore.asked.wait(), 10)
        await mesh.abort("a")
        kvstore.answer.set()
        with pytest.raises(ServiceError) as refused:
            await sub
        assert refused.value.reply.code is ErrorCode.ABORTED
        assert mesh.decode.table.get("a") is None and stats(mesh)["blocks_used"] == 0
        assert not mesh.decode.admitting
    finally:
        await mesh.close()


def stats(mesh: LocalMesh) -> dict:
    return mesh.decode.stats()


class SlowKvstore:
    """Decode's kvstore client, its lookups answered (a miss) once `answer` is set."""

    def __init__(self):
        self.counters: dict[str, int] = {}
        self.asked, self.answer = asyncio.Event(), asyncio.Event()

    async def lookup(self, keys) -> int:
        assert keys
        self.asked.set()
        await self.answer.wait()
        return 0


async def test_a_job_queued_at_once_is_acknowledged_after_it_is_queued(tiny_target,
                                                                      tiny_prompts):
    """The usual case is unchanged: the job is on the queue before the acknowledgement."""
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        ack = await mesh.submit("a", tiny_prompts[5], max_tokens=MAX_TOKENS, ignore_eos=True)
        assert ack.path.value == "pd" and len(mesh.jobs) == 1
        assert mesh.decode.table.state("a") is RequestStatus.AWAITING_KV
        assert not mesh.decode.queueing
    finally:
        await mesh.close()


class FastPrefill(LocalMesh):
    """Prefill takes the job the moment it is queued and decode finishes it (one token)
    before on_submit gets back from queueing it: a fast prefill on an idle mesh."""

    async def queue_job(self, job) -> None:
        await super().queue_job(job)
        task, _ = self.run_job()
        await task
        await asyncio.wait_for(self.finished[job.request_id].wait(), 30)


async def test_a_request_finished_before_its_ack_is_acknowledged_not_refused(tiny_target,
                                                                            tiny_prompts):
    """Before, on_submit took a request gone from its table for one aborted while being
    admitted: the gateway, its chunks already in hand, heard a refusal and answered 503
    (tests/e2e/test_fuzz_bodies.py, max_tokens 1)."""
    mesh = FastPrefill(tiny_target)
    await mesh.start()
    try:
        ack = await mesh.submit("one", tiny_prompts[5], max_tokens=1, ignore_eos=True)
        assert ack.path.value == "pd"
        assert mesh.decode.table.get("one") is None and len(await mesh.tokens("one")) == 1
    finally:
        await mesh.close()
