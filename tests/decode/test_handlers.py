"""Decode's and prefill's handlers in one process (tests/decode/local_mesh.py): the PD
lifecycle's hard cases, each made to happen in a named order, with the real engine on the
tiny model, the real write ledger, sender and request table, and KV over the in-memory
transport. Outputs are checked against the engine alone (deterministic mode)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.decode.request import RequestStatus

from .local_mesh import MAX_TOKENS, LocalMesh, until


def prompt(tiny_prompts, i: int, n: int = 40) -> list[int]:
    """A prompt of exactly n tokens (three 16-token blocks with max_tokens 8)."""
    p = list(tiny_prompts[i])
    while len(p) < n:
        p += tiny_prompts[(i + len(p)) % len(tiny_prompts)]
    return p[:n]


def stats(mesh: LocalMesh) -> dict:
    return mesh.decode.stats()


async def test_pd_in_process_equals_the_engine_alone(tiny_target, tiny_prompts, reference):
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        p = prompt(tiny_prompts, 0)
        ack = await mesh.submit("a", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert ack.path.value == "pd" and mesh.decode.table.state("a") is RequestStatus.AWAITING_KV
        task, msg = mesh.run_job()
        await task
        assert msg.acked and await mesh.tokens("a") == reference(p)
        assert stats(mesh)["blocks_used"] == 0 and mesh.prefill.ledger.stats()["attempts_open"] == 0
    finally:
        await mesh.close()


@pytest.mark.parametrize("delivered", [1, 2])
async def test_abort_while_awaiting_kv_then_the_claim_is_refused(tiny_target, tiny_prompts,
                                                                delivered):
    """Aborted before any prefill claimed it: the blocks are free at once, and the job,
    pulled afterwards, is refused before it computes anything and writes nothing (every
    attempt claims first, a first delivery and a redelivered job alike)."""
    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        await mesh.submit("a", prompt(tiny_prompts, 1), max_tokens=MAX_TOKENS)
        await mesh.abort("a")
        st = stats(mesh)
        assert st["reclaims_by_outcome"] == {"unclaimed": 1} and st["blocks_used"] == 0
        task, msg = mesh.run_job(delivered)
        await task
        pre = mesh.prefill.stats()
        assert msg.acked and pre["jobs_refused"] == 1 and pre["kv_writes"] == 0
        assert stats(mesh)["claims_refused"] == 1 and not mesh.prefill.pending
        assert mesh.prefill.engine.stats()["prompt_tokens"] == 0
        assert mesh.prefill.engine.stats()["blocks_used"] == 0
    finally:
        await mesh.close()


async def test_abort_mid_transfer_waits_for_the_write_in_flight(tiny_target, tiny_prompts):
    """Aborted while a claimed attempt has a write on the wire: the blocks stay
    quarantined, the ReclaimAck waits for that write, and only then are they freed."""
    mesh = LocalMesh(tiny_target, prefill={"kv_window": 1, "kv_max_write_bytes": 16 << 10},
                     gated=True)
    await mesh.start()
    try:
        await mesh.submit("a", prompt(tiny_prompts, 2), max_tokens=MAX_TOKENS)
        task, _ = mesh.run_job()
        await mesh.gate.waiting.wait()                      # write 0 issued, not delivered
        await mesh.abort("a")
        assert mesh.decode.table.state("a") is RequestStatus.ABORTING
        held = stats(mesh)["blocks_quarantined"]
        assert held > 0
        await until(lambda: mesh.prefill.ledger.cancelled == 1)   # the Reclaim arrived
        await asyncio.sleep(0.05)
        assert mesh.prefill.stats()["reclaims_answered"] == 0    # a write is still in flight
        assert stats(mesh)["blocks_quarantined"] == held
        mesh.gate.open()
        await task
        await until(lambda: stats(mesh)["reclaims"] == 1)
        st = stats(mesh)
        assert st["reclaims_by_outcome"] == {"acked": 1} and st["blocks_quarantined"] == 0
        assert st["kv_writes_quarantined"] == 1             # the hazard: a write after the abort
        assert st["blocks_used"] == 0 and mesh.decode.table.get("a") is None
        assert mesh.prefill.stats()["kv_writes"] == 0 and mesh.prefill.ledger.cancelled == 1
    finally:
        await mesh.close()


@pytest.mark.parametrize("fence", [True, False], ids=["fence", "no_fence"])
async def test_late_write_after_the_lease_never_reaches_the_next_request(
        tiny_target, tiny_prompts, reference, fence):
    """The owner of an aborted request's blocks goes silent with a write on the wire; the
    lease frees the blocks and the next request gets them; then the late write arrives.
    It is refused and the next request's output is right. With the epoch fence off (TEST
    ONLY) the owner check still refuses it, failing closed: its request holds no grant any
    more (before issue 29 it let such a write through to the fence, and it landed in the
    next request's KV). The fence alone: test_a_write_meant_for_a_previous_life..."""
    flat = {"num_blocks": 3, "fault_no_epoch_fence": not fence}
    mesh = LocalMesh(tiny_target, decode=flat, gated=True)
    await mesh.start(decode_loop=False)
    try:
        a, b = prompt(tiny_prompts, 3), prompt(tiny_prompts, 7)
        await mesh.submit("a", a, max_tokens=MAX_TOKENS, ignore_eos=True)
        task_a, _ = mesh.run_job()
        await mesh.gate.waiting.wait()                      # a's write 0 on the wire
        mesh.prefill_dead = True                            # its prefill stops answering
        await mesh.abort("a")
        assert stats(mesh)["blocks_quarantined"] == 3
        mesh.decode.reclaimer.sweep(time.monotonic() + mesh.decode.table.lease_s)  # lease ends
        assert stats(mesh)["reclaims_by_outcome"] == {"lease": 1}
        await mesh.submit("b", b, max_tokens=MAX_TOKENS, ignore_eos=True)
        mesh.prefill.sender.transport = mesh.kv            # b's KV goes straight through
        task_b, _ = mesh.run_job()
        await task_b
        assert mesh.decode.table.state("b") is RequestStatus.RUNNING
        mesh.gate.open()                                    # a's late write arrives now
        await task_a
        st = stats(mesh)
        applied = st["kv_writes_applied"]
        assert st["kv_writes_fenced"] >= 1 and st["kv_writes_stray"] >= 1
        mesh.start_decoding()
        assert await mesh.tokens("b") == reference(b)
        assert stats(mesh)["kv_writes_applied"] == applied       # none of a's landed
    finally:
        await mesh.close()


@pytest.mark.parametrize("guards", ["owner_check", "epoch_base", "none"])
async def test_a_write_meant_for_a_previous_life_never_lands(tiny_target, tiny_prompts, guards):
    """A decode instance restarts under the same id and reserves the same request again;
    a write its previous life's prefill still had on the wire arrives. The owner check
    refuses it (its attempt was never granted here); with the owner check off (reclaim-ack
    off: TEST ONLY) the random epoch base of the new life fences it; with neither (a fixed
    epoch base, as before incarnations) it lands in the new life's blocks."""
    decode = {"instance_id": "decode_0", "num_blocks": 8}
    if guards != "owner_check":
        decode["fault_no_reclaim_ack"] = True
    old, new = LocalMesh(tiny_target, decode=decode, gated=True), LocalMesh(tiny_target,
                                                                            decode=decode)
    if guards == "none":
        for life in (old, new):
            life.decode.engine.pool._next_epoch = 1
    await old.start(decode_loop=False)
    await new.start(decode_loop=False)
    try:
        p = prompt(tiny_prompts, 5)
        await old.submit("a", p, max_tokens=MAX_TOKENS)
        task, _ = old.run_job()
        await old.gate.waiting.wait()                     # the old life's write is in flight
        await new.submit("a", p, max_tokens=MAX_TOKENS)   # the new life reserves it again
        old_dest, new_dest = old.decode.table.get("a").grant, new.decode.table.get("a").grant
        assert old_dest.block_ids == new_dest.block_ids
        assert (old_dest.epochs == new_dest.epochs) == (guards == "none")
        old.kv.hub[old.decode.iid] = new.kv.hub[new.decode.iid]   # its wire now ends at the new life
        old.gate.open()
        await task
        st = stats(new)
        issued = next(iter(old.prefill.ledger.entries.values())).issued   # layer-wise: several
        landed = {"owner_check": 0, "epoch_base": 0, "none": issued}[guards]
        assert st["kv_writes_applied"] == landed
        assert st["kv_writes_not_owner"] == (guards == "owner_check")
    finally:
        await old.close()
        await new.close()


async def test_a_silent_prefill_on_an_idle_mesh_is_prefilled_here(tiny_target, tiny_prompts,
                                                                  reference):
    """No prefill ever takes the job, and nothing else is running: the sweep's fallback
    (prefill_timeout_s) must wake the sleeping engine loop itself, or the request waits
    for the next arrival (in a chaos run, for the gateway's 60 s progress timeout)."""
    mesh = LocalMesh(tiny_target, decode={"prefill_timeout_s": 0.2})
    await mesh.start()
    mesh.tasks.append(asyncio.ensure_future(mesh.decode.reclaimer.run(0.2)))
    try:
        p = prompt(tiny_prompts, 6)
        await mesh.submit("a", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        await asyncio.sleep(0.05)           # the engine loop is asleep: nothing to step
        assert await mesh.tokens("a", timeout=10) == reference(p)
        st = stats(mesh)
        assert st["prefill_fallbacks"] == 1 and st["blocks_used"] == 0
    finally:
        await mesh.close()


async def test_a_granted_attempt_cannot_write_outside_its_grant(tiny_target, tiny_prompts,
                                                                reference):
    """A compromised prefill claims a job it pulled (a legitimate grant for a's blocks),
    then aims a write at b's blocks, naming their current epochs. The owner check fails
    closed on any block outside the grant: refused, and b answers right. Before issue 29
    only the epoch fence looked at block ids, and with the right epochs the write landed."""
    from shared.contracts.kv import KvWrite
    from shared.contracts.reclaim import PrefillClaim
    from shared.kv import wire

    mesh = LocalMesh(tiny_target, gated=True)
    await mesh.start(decode_loop=False)
    try:
        b, a = prompt(tiny_prompts, 3), prompt(tiny_prompts, 7)
        await mesh.submit("b", b, max_tokens=MAX_TOKENS, ignore_eos=True)
        task_b, _ = mesh.run_job()
        await mesh.gate.waiting.wait()
        b_blocks = list(mesh.decode.table.get("b").grant.block_ids)
        mesh.gate.open()
        await task_b
        assert mesh.decode.table.state("b") is RequestStatus.RUNNING
        await mesh.submit("a", a, max_tokens=MAX_TOKENS, ignore_eos=True)
        g = mesh.decode.table.get("a").grant
        await mesh.decode.on_claim(PrefillClaim(request_id="a", attempt="evil",
                                                prefill_instance="prefill_0",
                                                block_ids=g.block_ids, epochs=g.epochs))
        assert "evil" in g.owners                          # the grant is real
        kv, pool = mesh.decode.engine.kv, mesh.decode.engine.pool
        aim = [g.block_ids[0], b_blocks[0]]                # one of its own, one of b's
        shape = [kv.shape[0], 2, len(aim), *kv.shape[3:]]
        meta = KvWrite(request_id="a", attempt="evil", sender="prefill_0", seq=0,
                       block_ids=aim, epochs=[pool.epoch[x] for x in aim], layer_start=0,
                       layer_end=kv.shape[0], dtype=wire.dtype_name(kv.dtype), shape=shape)
        payload = bytes([0x7F]) * wire.write_bytes(meta)
        ack = await mesh.kv.send(mesh.decode.iid, wire.signed(meta, payload), payload)
        assert not ack.applied
        assert stats(mesh)["kv_writes_not_owner"] == 1
        mesh.start_decoding()
        assert await mesh.tokens("b") == reference(b)
    finally:
        await mesh.close()


async def test_a_gateway_asking_for_progress_hears_the_chunks_sent(tiny_target, tiny_prompts,
                                                                    reference):
    """ProgressQuery (the gateway's probe.py): a request waiting for its KV has sent no chunk
    yet; one that ended, or that this instance never had, is not served here (-1)."""
    from shared.contracts.common import Codec
    from shared.contracts.messages import ProgressQuery, ProgressReply

    def sent(reply: bytes) -> int:
        return Codec(ProgressReply).decode(reply).sent

    mesh = LocalMesh(tiny_target)
    await mesh.start()
    try:
        p = prompt(tiny_prompts, 1)
        await mesh.submit("a", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert sent(await mesh.decode.on_progress(ProgressQuery(request_id="a"))) == 0
        task, _ = mesh.run_job()
        await task
        assert await mesh.tokens("a") == reference(p)
        assert sent(await mesh.decode.on_progress(ProgressQuery(request_id="a"))) == -1
        assert sent(await mesh.decode.on_progress(ProgressQuery(request_id="zz"))) == -1
    finally:
        await mesh.close()
