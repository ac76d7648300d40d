"""Layer-wise KV streaming (services/prefill/stream.py) in one process: the KV of each
layer of each chunk leaves while later layers compute, decode's output equals the engine
alone, the write ledger counts every write exactly, and blocks prefill did not compute
(its own prefix-cache hits) still reach decode."""
from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from services.prefill.stream import LayerStream

from .local_mesh import MAX_TOKENS, LocalMesh
from .test_handlers import prompt


class Watch:
    """A KV transport that records, per write, its layers and whether the prompt was
    still computing when it was sent."""

    def __init__(self, inner, prefill):
        self.inner, self.prefill = inner, prefill
        self.sent: list[tuple[int, int, bool]] = []

    @property
    def max_payload(self) -> int:
        return self.inner.max_payload

    async def send(self, dest, meta, payload):
        self.sent.append((meta.layer_start, meta.layer_end, bool(self.prefill.pending)))
        return await self.inner.send(dest, meta, payload)

    async def listen(self, instance_id, on_write, admit=None):
        await self.inner.listen(instance_id, on_write, admit)

    async def close(self):
        await self.inner.close()


def watched(mesh: LocalMesh) -> Watch:
    w = Watch(mesh.kv, mesh.prefill)
    mesh.prefill.sender.transport = w
    return w


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_streamed_kv_gives_the_same_output(tiny_target, tiny_prompts, reference, stream):
    mesh = LocalMesh(tiny_target, prefill={"kv_stream": "on" if stream else "off"})
    w = watched(mesh)
    await mesh.start()
    try:
        p = prompt(tiny_prompts, 3, n=120)            # four 32-token chunks
        await mesh.submit("a", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        task, msg = mesh.run_job()
        await task
        assert msg.acked and await mesh.tokens("a") == reference(p)
        pre = mesh.prefill.stats()
        e = next(iter(mesh.prefill.ledger.entries.values()))
        assert e.issued == e.completed == pre["kv_writes"] == len(w.sent)
        during = [s for s in w.sent if s[2]]
        if stream:   # writes left while the prompt computed, single layers among them
            assert during and pre["kv_writes_streamed"] > 0
            assert any(l1 - l0 == 1 for l0, l1, _ in during)
        else:
            assert not during and pre["kv_writes_streamed"] == 0
        assert mesh.decode.stats()["blocks_used"] == 0
    finally:
        await mesh.close()


async def test_blocks_prefill_did_not_compute_still_reach_decode(tiny_target, tiny_prompts,
                                                                 reference):
    """The second job hits prefill's own L1 for the whole-block prefix (decode, without a
    prefix cache, wants every block): those blocks go after the compute."""
    mesh = LocalMesh(tiny_target, decode={"prefix_cache": False})
    await mesh.start()
    try:
        p = prompt(tiny_prompts, 4, n=100)
        for rid in ("a", "b"):
            await mesh.submit(rid, p, max_tokens=MAX_TOKENS, ignore_eos=True)
            task, _ = mesh.run_job()
            await task
            assert await mesh.tokens(rid) == reference(p)
        assert mesh.prefill.engine.stats()["prefix_hit_tokens"] > 0
    finally:
        await mesh.close()


class _Sender:
    def __init__(self, max_bytes):
        self.limit, self.window, self.ledger = max_bytes, 4, None

    def max_bytes(self, dest):
        return self.limit


class _Engine:
    def __init__(self, kv):
        self.kv = kv
        self.cfg = type("C", (), {"block_size": kv.shape[3]})()


class _Dest:
    def __init__(self, n, skip):
        self.block_ids, self.skip_blocks, self.epochs = list(range(n)), skip, [0] * n
        self.instance_id = "d0"


class _Job:
    def __init__(self, n_tokens, n_blocks, skip=0):
        self.prompt_ids, self.dest = [0] * n_tokens, _Dest(n_blocks, skip)


def test_ready_layers_coalesce_into_rectangles():
    import torch
    kv = torch.zeros(4, 2, 8, 16, 1, 8)               # 4 layers, 16-token blocks
    lb = 2 * 16 * 8 * 4
    st = LayerStream(_Sender(1 << 20), _Job(64, 4), _Engine(kv), "r", "a", loop=_Loop())
    st.computed(0, 0, 32)                             # chunk 1 (blocks 0, 1), layer 0
    p = st.next_piece()
    assert (p.b0, p.b1, p.l0, p.l1) == (0, 2, 0, 1)
    assert st.next_piece() is None
    for layer in (1, 2, 3):
        st.computed(layer, 0, 32)
    st.computed(0, 32, 64)                            # chunk 2, layer 0
    p = st.next_piece()                               # layers 1..3 of chunk 1 together
    assert (p.b0, p.b1, p.l0, p.l1) == (0, 2, 1, 4)
    p = st.next_piece()
    assert (p.b0, p.b1, p.l0, p.l1) == (2, 4, 0, 1)
    # a small max payload splits by layers, then by blocks
    st = LayerStream(_Sender(lb), _Job(64, 4), _Engine(kv), "r", "a", loop=_Loop())
    for layer in range(4):
        st.computed(layer, 0, 64)
    got = []
    while (p := st.next_piece()) is not None:
        got.append((p.b0, p.b1, p.l0, p.l1))
    assert got[0] == (0, 1, 0, 1) and len(got) == 16


def test_partial_blocks_wait_for_the_chunk_that_completes_them():
    import torch
    kv = torch.zeros(2, 2, 8, 16, 1, 8)
    st = LayerStream(_Sender(1 << 20), _Job(40, 3), _Engine(kv), "r", "a", loop=_Loop())
    st.computed(0, 0, 24)                             # block 1 only half computed
    p = st.next_piece()
    assert (p.b0, p.b1) == (0, 1)
    st.computed(1, 0, 24)
    st.computed(0, 24, 40)                            # the last chunk: the partial last block
    p = st.next_piece()
    assert (p.b0, p.b1, p.l0, p.l1) == (0, 1, 1, 2)
    p = st.next_piece()
    assert (p.b0, p.b1, p.l0, p.l1) == (1, 3, 0, 1)


class _Loop:
    def call_soon_threadsafe(self, fn, *args):
        fn(*args)



class _Ledger:
    def __init__(self):
        self.stopped = False

    def may_issue(self, attempt):
        return not self.stopped


class _WritingSender(_Sender):
    """Writes complete at once (the next loop turn) and are recorded."""

    def __init__(self, max_bytes, window):
        super().__init__(max_bytes)
        self.window, self.ledger, self.counters = window, _Ledger(), defaultdict(int)
        self.pieces = []

    async def write(self, job, engine, attempt, src, p, errors):
        await asyncio.sleep(0)
        self.pieces.append((p.b0, p.b1, p.l0, p.l1))
        return 1


class _HoldingEngine(_Engine):
    @property
    def port(self):                    # the engine's KvPort: only kept_blocks is read
        return self

    def kept_blocks(self, rid):
        return list(range(self.kv.shape[2]))


@pytest.mark.parametrize("window", [1, 2])
async def test_the_stream_drains_when_every_write_of_a_full_window_has_completed(window):
    """A full window of writes that all completed before the pump looked again must free
    the window: once it waited with nothing in flight and ready layers unsent, for a wake
    that never came (the chaos run's prefill jobs that never finished, issue 14)."""
    import torch
    kv = torch.zeros(4, 2, 8, 16, 1, 8)
    sender = _WritingSender(2 * 16 * 8 * 4, window)            # one block-layer per write
    st = LayerStream(sender, _Job(64, 4), _HoldingEngine(kv), "r", "a",
                     asyncio.get_running_loop())
    st.task = asyncio.ensure_future(st.pump())
    for layer in range(4):
        st.computed(layer, 0, 64)                              # 16 pieces ready at once
    errors, nbytes = await asyncio.wait_for(st.finish(), 5)
    assert errors == [] and nbytes == 16 and len(set(sender.pieces)) == 16


class Throttle:
    """A KV transport behind a link of `rate` bytes/s: one write on the wire at a time."""

    def __init__(self, inner, rate: float):
        self.inner, self.rate = inner, rate
        self.wire = asyncio.Lock()

    @property
    def max_payload(self) -> int:
        return self.inner.max_payload

    async def send(self, dest, meta, payload):
        async with self.wire:
            await asyncio.sleep(len(payload) / self.rate)
        return await self.inner.send(dest, meta, payload)

    async def listen(self, instance_id, on_write, admit=None):
        await self.inner.listen(instance_id, on_write, admit)

    async def close(self):
        await self.inner.close()


@pytest.mark.parametrize("rate", [0.5e6, None], ids=["slow_link", "fast_link"])
async def test_auto_streams_only_across_a_link_that_costs(tiny_target, tiny_prompts, reference,
                                                         rate):
    """kv_stream=auto (the default): the first job measures the link (whole-prompt KV);
    after it, a link whose wire time is a real share of the compute gets layer-wise
    streaming, a fast one keeps the whole-prompt path; the output is the same."""
    mesh = LocalMesh(tiny_target)
    assert mesh.prefill.cfg.kv_stream == "auto"
    if rate:
        mesh.prefill.sender.transport = Throttle(mesh.kv, rate)
    await mesh.start()
    try:
        for i, rid in enumerate(("a", "b", "c")):
            p = prompt(tiny_prompts, 3 + i, n=120)        # four 32-token chunks
            await mesh.submit(rid, p, max_tokens=MAX_TOKENS, ignore_eos=True)
            task, msg = mesh.run_job()
            await task
            assert msg.acked and await mesh.tokens(rid) == reference(p)
        pre = mesh.prefill.stats()
        choice = pre["kv_stream_choice"][mesh.decode.iid]
        if rate:
            assert (pre["kv_jobs_whole"], pre["kv_jobs_streamed"]) == (1, 2), choice
            assert pre["kv_writes_streamed"] > 0 and choice.startswith("stream")
            link = pre["kv_link_bytes_per_s"][mesh.decode.iid]
            assert rate * 0.5 < link <= rate
        else:
            assert (pre["kv_jobs_whole"], pre["kv_jobs_streamed"]) == (3, 0), choice
            assert pre["kv_writes_streamed"] == 0 and choice.startswith("whole")
    finally:
        await mesh.close()
