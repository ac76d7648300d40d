"""The short-prompt PD path (services/prefill/service.py: attempt; sender.py: send): an
attempt claims, then computes, and a prompt whose KV fits one write sends its
PrefillDone in that write, so decode starts the request as the write lands. In one
process (local_mesh.py), the real engine on the tiny model, outputs against the engine
alone (deterministic mode)."""
from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest

from .local_mesh import MAX_TOKENS, JobMsg, LocalMesh, until
from .test_handlers import prompt


async def serve_one(mesh: LocalMesh, p: list[int], reference, delivered: int = 1):
    """Submit p, let prefill run its job, check decode's tokens against the engine alone;
    the job's message."""
    await mesh.submit("a", p, max_tokens=MAX_TOKENS, ignore_eos=True)
    task, msg = mesh.run_job(delivered)
    await task
    assert await mesh.tokens("a") == reference(p)
    return msg


async def test_a_prompt_in_one_write_starts_on_that_write(tiny_target, tiny_prompts, reference):
    """One KV write carries the PrefillDone: no separate message, the output is the
    engine alone's, nothing is left open on either side."""
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        msg = await serve_one(mesh, prompt(tiny_prompts, 0), reference)
        pre = mesh.prefill.stats()
        assert msg.acked and pre["kv_writes"] == 1 and pre["kv_done_in_write"] == 1
        assert mesh.dones == [] and pre["jobs_done"] == 1
        assert mesh.decode.stats()["prefill_fallbacks"] == 0
        assert pre["attempts_open"] == 0
        await until(lambda: mesh.decode.stats()["blocks_used"] == 0)
    finally:
        await mesh.close()


async def test_a_prompt_in_several_writes_reports_after_them(tiny_target, tiny_prompts, reference):
    """Several writes: each is acknowledged, then one PrefillDone counts them all."""
    mesh = LocalMesh(tiny_target, prefill={"kv_max_write_bytes": 16 << 10})
    await mesh.start()
    try:
        await serve_one(mesh, prompt(tiny_prompts, 1), reference)
        pre = mesh.prefill.stats()
        assert pre["kv_writes"] > 1 and pre["kv_done_in_write"] == 0
        assert [d.writes_issued for d in mesh.dones] == [pre["kv_writes"]]
    finally:
        await mesh.close()


class StaleEpochs:
    """A KV transport that delivers the write carrying a PrefillDone with its epochs
    one ahead: a write decode must fence (as it fences a late write of another life)."""

    def __init__(self, inner):
        self.inner = inner
        self.max_payload = inner.max_payload

    async def send(self, dest, meta, payload):
        if meta.done is not None:
            meta = msgspec.structs.replace(meta, epochs=[e + 1 for e in meta.epochs])
        return await self.inner.send(dest, meta, payload)


async def test_a_fenced_write_never_starts_its_request(tiny_target, tiny_prompts, reference):
    """The write carrying the PrefillDone is fenced: its KV did not land, so decode must
    not start the request on it (the blocks hold no prompt). It prefills the prompt
    itself, and the output is still the engine alone's."""
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        mesh.prefill.sender.transport = StaleEpochs(mesh.kv)
        await serve_one(mesh, prompt(tiny_prompts, 2), reference)
        st = mesh.decode.stats()
        assert st["kv_writes_fenced"] == 1 and st["kv_writes_applied"] == 0
        assert st["prefill_fallbacks"] == 1
        assert mesh.prefill.stats()["jobs_failed"] == 1     # and prefill says so too
    finally:
        await mesh.close()


@pytest.mark.parametrize("delivered", [1, 2])
async def test_nothing_is_computed_while_the_claim_is_out(tiny_target, tiny_prompts, reference,
                                                          delivered):
    """One claim order: every attempt (a first delivery or a redelivered job alike) claims
    before it computes, so a refused claim costs nothing; the claim answered late still
    gives the right output."""
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    seen = []

    async def answer_late():
        await asyncio.sleep(0.2)
        seen.append((mesh.prefill.engine.stats()["prompt_tokens"], dict(mesh.prefill.pending)))

    try:
        mesh.claim_gate = answer_late
        await serve_one(mesh, prompt(tiny_prompts, 4), reference, delivered)
        assert seen == [(0, {})]
    finally:
        await mesh.close()


class Puller:
    """The work queue as prefill's fetch loop sees it: the given jobs, then none; what
    prefill's engine held at each pull request."""

    def __init__(self, engine, msgs: list[JobMsg]):
        self.engine, self.msgs, self.held = engine, msgs, []

    async def fetch(self, batch: int = 1, timeout: float = 1.0):
        self.held.append(sorted(self.engine.requests))
        if self.msgs:
            return [self.msgs.pop(0)]
        await asyncio.sleep(timeout)
        raise nats.errors.TimeoutError


async def test_a_refused_job_does_not_hold_up_the_next_pull(tiny_target, tiny_prompts):
    """A job prefill refuses (another tokenizer) is reported to decode; while decode is
    slow to take that report, the fetch loop already pulls the next job."""
    mesh = LocalMesh(tiny_target, prefill={"max_jobs": 2})
    await mesh.start()
    slow = asyncio.Event()

    async def slow_report(decode, done, timeout):
        await slow.wait()

    try:
        await mesh.submit("a", prompt(tiny_prompts, 7), max_tokens=MAX_TOKENS)
        job = msgspec.structs.replace(mesh.jobs.pop(0), tokenizer_fingerprint="another")
        mesh.prefill_done = slow_report
        puller = mesh.prefill.psub = Puller(mesh.prefill.engine, [JobMsg(job)])
        mesh.tasks.append(asyncio.ensure_future(mesh.prefill.fetch_loop()))
        await until(lambda: len(puller.held) >= 2)
        assert mesh.prefill.active == 1              # the refusal is still being reported
        slow.set()
        await until(lambda: mesh.prefill.stats()["jobs_failed"] == 1)
    finally:
        await mesh.close()
