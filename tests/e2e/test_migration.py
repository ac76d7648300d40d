"""Invariant 7: no request lost or silently cut. A decode instance killed mid-stream, a
lost token chunk, a lost final chunk: the gateway moves the request to another decode
instance with the tokens so far, and the client's stream goes on with no gap and no
duplicate, equal to the uninterrupted output. A gateway killed mid-stream: decode aborts
its orphans within seconds. Overload is refused with 429 + Retry-After, not queued."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import body, micro_stats, sse_events

GATEWAY = {"decode_dead_after_s": 2.0, "progress_timeout_s": 3.0}


def params(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


def want(model, prompt, max_tokens: int) -> list[int]:
    return reference_engine(model).generate([prompt], SamplingParams(**params(max_tokens)))[
        0]["token_ids"]


async def stream(url: str, prompt, max_tokens: int, on_tokens=None, **kw):
    """Token ids of a streamed completion, the decode instance that started it, and the
    first error event (None if it completed)."""
    toks: list[int] = []
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body(
                prompt, stream=True, **params(max_tokens), **kw)) as r:
            assert r.status == 200, await r.text()
            first = r.headers["x-pdmesh-decode"]
            async for ev in sse_events(r):
                if "error" in ev:
                    return toks, first, ev["error"]
                for ch in ev["choices"]:
                    toks += ch.get("token_ids") or []
                if on_tokens is not None:
                    on_tokens(first, len(toks))
    return toks, first, None


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_decode_killed_mid_stream_the_request_migrates_and_equals_the_reference(
        tiny_target, tiny_prompts):
    prompt, n = tiny_prompts[4], 160
    with Cluster(str(tiny_target), prefill=1, decode=2, **DET, echo=False,
                 overrides=det_overrides() | {"gateway": GATEWAY}) as c:
        killed: list[str] = []

        def kill_at_16(first: str, got: int) -> None:
            if got >= 16 and not killed:
                name = first.replace("_", "-")       # instance decode_0 runs as decode-0
                c.kill(name)
                killed.append(name)

        toks, first, error = asyncio.run(asyncio.wait_for(
            stream(c.url, prompt, n, kill_at_16), 120))
        assert error is None and killed
        assert toks == want(tiny_target, prompt, n)           # no gap, no duplicate
        assert asyncio.run(metric(c.url, "pdmesh_migrations_total")) == 1


def test_a_lost_chunk_and_a_lost_final_chunk_are_never_taken_for_the_end(tiny_target,
                                                                         tiny_prompts):
    """decode-0 loses chunk 5 of every request; decode-1 loses every final chunk. Each
    loss is detected (a seq gap; the progress deadline) and the request moves on."""
    faulty = {"decode-0": {"fault_drop_chunk_seq": 5}, "decode-1": {"fault_drop_last_chunk": True}}
    with Cluster(str(tiny_target), prefill=0, decode=3, **DET, echo=False,
                 overrides=det_overrides() | {"gateway": GATEWAY} | faulty) as c:
        async def run():
            out = []
            for r in range(2):       # three at once: least-loaded routing spreads them
                ps = tiny_prompts[3 * r:3 * r + 3]
                res = await asyncio.gather(*(stream(c.url, p, 24) for p in ps))
                out += [(p, *x) for p, x in zip(ps, res)]
            return out

        got = asyncio.run(asyncio.wait_for(run(), 180))
        starts = [first for _, _, first, _ in got]
        assert {"decode_0", "decode_1"} <= set(starts), starts
        for prompt, toks, _, error in got:
            assert error is None and toks == want(tiny_target, prompt, 24)
        faulty_starts = sum(s in ("decode_0", "decode_1") for s in starts)
        assert asyncio.run(metric(c.url, "pdmesh_migrations_total")) >= faulty_starts


def test_killed_gateway_leaves_no_orphans(tiny_target, tiny_prompts):
    overrides = det_overrides(gateway_dead_after_s=2.0)
    with Cluster(str(tiny_target), prefill=0, decode=1, **DET, echo=False,
                 overrides=overrides) as c:
        async def run():
            started = asyncio.Event()
            req = asyncio.ensure_future(stream(
                c.url, tiny_prompts[0], 3000, lambda _f, n: n >= 3 and started.set()))
            await asyncio.wait_for(started.wait(), 60)
            c.kill("gateway-0")
            t0 = time.monotonic()
            while (await micro_stats(c.nats_url, "decode"))["running"] > 0:
                assert time.monotonic() - t0 < 10, "decode still generating for nobody"
                await asyncio.sleep(0.5)
            req.cancel()
            return time.monotonic() - t0

        waited = asyncio.run(run())
        assert waited < 10


def test_overload_is_refused_with_429_not_queued(tiny_target, tiny_prompts):
    """One decode that batches 2 and queues at most 1: of 8 concurrent long requests the
    excess gets 429 + Retry-After at once, and every admitted one completes."""
    overrides = det_overrides(max_num_seqs=2, max_queued=1)
    with Cluster(str(tiny_target), prefill=0, decode=1, **DET, echo=False,
                 overrides=overrides | {"gateway": {"max_in_flight": 100}}) as c:
        async def one(http, i):
            t0 = time.monotonic()
            async with http.post(c.url + "/v1/completions", json=body(
                    tiny_prompts[i], **params(64))) as r:
                data = await r.json()
                return r.status, r.headers.get("Retry-After"), data, time.monotonic() - t0

        async def run():
            async with aiohttp.ClientSession() as http:
                return await asyncio.gather(*(one(http, i) for i in range(8)))

        res = asyncio.run(run())
        ok = [r for r in res if r[0] == 200]
        refused = [r for r in res if r[0] == 429]
        assert len(ok) + len(refused) == 8 and ok and refused, [r[0] for r in res]
        for status, retry_after, data, took in refused:
            assert retry_after == "1" and data["error"]["code"] == "rate_limit_exceeded"
        # at once: every refusal is answered before any admitted request has finished (not a
        # time bound; a refusal that queued would wait for one)
        assert max(r[3] for r in refused) < min(r[3] for r in ok), [(r[0], r[3]) for r in res]
        for _, _, data, _ in ok:
            assert len(data["choices"][0]["token_ids"]) == 64
