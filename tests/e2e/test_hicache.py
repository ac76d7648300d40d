"""HiCache over the real mesh: prefix hits from L1 (engine pools), L2 (kvstore host
memory) and L3 (kvstore disk) give the same tokens as no cache at all; layer loads that
land late are waited for; tiny budgets evict without harm; a corrupted disk block is
caught by its checksum and recomputed; kvstore dying mid-run costs only misses.

PDMESH_FAULT_NO_LOAD_GUARD=1 (manual runs only) turns the readiness guard off in the
delayed-load mesh, and test_l2_hits_with_slow_layer_loads then fails.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import random
import re
import shlex
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import micro_stats

MAX_TOKENS = 10


def shared_prefix_prompts(tok, n: int = 20, seed: int = 7) -> list[list[int]]:
    """n prompts sharing a 400-token context (real code), each with its own tail."""
    rng = random.Random(seed)
    ctx = tok.encode(inspect.getsource(textwrap))[:400]
    tails = tok.encode(inspect.getsource(shlex))
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(tails) - 40)
        out.append(ctx + tails[i:i + rng.randrange(5, 40)])
    return out


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return shared_prefix_prompts(tiny_tokenizer)


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    eng = reference_engine(tiny_target, prefix_cache=False)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r["token_ids"] for r in eng.generate(prompts, sp)]


def _mesh(tiny_target, store: dict, l1: bool, **prefill):
    ov = det_overrides(prefix_cache=l1)
    ov["prefill"] |= {"prefix_cache": l1} | prefill
    ov["kvstore"] = store
    return Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=ov, echo=False)


async def _complete(http, url, prompt) -> tuple[list[int], int]:
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "pdmesh_path": "pd"}
    async with http.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _stored(nats_url: str, at_least: int, timeout: float = 20.0) -> dict:
    """Wait until kvstore has indexed `at_least` write-back blocks (write-back is async)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await micro_stats(nats_url, "kvstore")
        if st.get("blocks_stored", 0) >= at_least or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.2)


def run_prompts(mesh, prompts, seed_first=True) -> tuple[list[list[int]], list[int]]:
    """The first prompt alone (its prefix is written back), then the rest."""
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
            out = []
            if seed_first:
                out.append(await _complete(http, mesh.url, prompts[0]))
                await _stored(mesh.nats_url, 1)
            for p in prompts[len(out):]:
                out.append(await _complete(http, mesh.url, p))
            return [o[0] for o in out], [o[1] for o in out]
    return asyncio.run(go())


def test_l1_hits_equal_no_cache(tiny_target, prompts, reference):
    with _mesh(tiny_target, {}, l1=True, kvstore=False) as mesh:
        got, cached = run_prompts(mesh, prompts, seed_first=False)
        pre = asyncio.run(micro_stats(mesh.nats_url, "prefill"))
        dec = asyncio.run(micro_stats(mesh.nats_url, "decode"))
    assert got == reference
    assert cached[0] == 0 and all(c >= 384 for c in cached[1:]), cached
    assert pre["prefix_hit_tokens"] >= 19 * 384 and pre["kv_loads"] == 0
    assert dec["l1_hit_blocks"] >= 19 * 24      # decode was not sent the prefix again


@pytest.fixture(scope="module")
def l2_mesh(tiny_target):
    guard_off = bool(os.environ.get("PDMESH_FAULT_NO_LOAD_GUARD"))
    with _mesh(tiny_target, {"disk_cache_mb": 0}, l1=False, fault_load_delay_s=0.03,
               fault_no_load_guard=guard_off) as mesh:
        yield mesh


def test_l2_hits_with_slow_layer_loads(l2_mesh, prompts, reference):
    got, cached = run_prompts(l2_mesh, prompts)
    kv = asyncio.run(micro_stats(l2_mesh.nats_url, "kvstore"))
    pre = asyncio.run(micro_stats(l2_mesh.nats_url, "prefill"))
    wrong = sum(g != r for g, r in zip(got, reference))
    assert wrong == 0, f"{wrong} of {len(got)} outputs differ from the uncached reference"
    assert all(c >= 384 for c in cached[1:]), cached
    assert kv["l2_hits"] >= 19 * 24 and kv["l3_entries"] == 0
    # one lookup per request: decode asks, its PrefillJob tells prefill (before: 2 each)
    assert kv["lookups"] == len(prompts), kv["lookups"]
    assert pre["kv_loads"] >= 19 and pre["kv_load_failures"] == 0 and pre["l1_hit_blocks"] == 0
    dec = asyncio.run(micro_stats(l2_mesh.nats_url, "decode"))
    assert dec["kv_loads"] >= 19 and dec["kv_load_failures"] == 0   # decode loads the prefix too


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def l3_mesh(tiny_target):
    # no L2, a 0.5 MiB disk tier: about 10 blocks of this model (48 KiB each) fit
    with _mesh(tiny_target, {"host_cache_mb": 0, "disk_cache_mb": 0.5}, l1=False) as mesh:
        yield mesh


def _disk_dir(mesh) -> Path:
    return Path(mesh.tmp) / "kvstore-0"


def test_l3_hits_and_eviction_under_a_tiny_budget(l3_mesh, prompts, reference):
    # a short shared prefix (the first 160 tokens: 10 blocks) fits the budget
    short = [p[:160] + p[400:] for p in prompts]
    eng_ref = reference_engine(l3_mesh.model, prefix_cache=False)
    want = [r["token_ids"] for r in eng_ref.generate(
        short, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    got, cached = run_prompts(l3_mesh, short)
    assert got == want
    kv = asyncio.run(micro_stats(l3_mesh.nats_url, "kvstore"))
    assert kv["l3_hits"] > 0 and sum(c > 0 for c in cached) >= 10, cached
    # the long prompts overflow the budget: evictions, no wrong output
    got, _ = run_prompts(l3_mesh, prompts)
    assert got == reference
    kv = asyncio.run(micro_stats(l3_mesh.nats_url, "kvstore"))
    assert kv["l3_evictions"] > 0
    on_disk = _disk_bytes(_disk_dir(l3_mesh))
    assert on_disk == kv["l3_bytes"] <= 0.5 * 2**20, (on_disk, kv["l3_bytes"])


def test_corrupt_l3_block_is_detected_and_recomputed(l3_mesh, prompts, reference):
    p = prompts[3][:160] + prompts[3][400:]
    want = reference_engine(l3_mesh.model, prefix_cache=False).generate(
        [p], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]["token_ids"]
    run_prompts(l3_mesh, [p], seed_first=True)      # its blocks are on disk now
    files = sorted(f for f in _disk_dir(l3_mesh).rglob("*") if f.is_file())
    assert files
    for f in files:                                  # flip bytes in every block file
        raw = bytearray(f.read_bytes())
        for i in range(len(raw) // 2, len(raw) // 2 + 64):
            raw[i] ^= 0xFF
        f.write_bytes(bytes(raw))
    before = asyncio.run(micro_stats(l3_mesh.nats_url, "kvstore"))
    got, cached = run_prompts(l3_mesh, [p], seed_first=False)
    after = asyncio.run(micro_stats(l3_mesh.nats_url, "kvstore"))
    assert got == [want] and cached == [0]
    assert after["checksum_failures"] > before.get("checksum_failures", 0)


def test_kvstore_killed_and_restarted_mid_run(tiny_target, prompts, reference):
    with _mesh(tiny_target, {}, l1=False) as mesh:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
                async def one(i):
                    await asyncio.sleep(0.15 * i)
                    return await _complete(http, mesh.url, prompts[i])
                tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
                await asyncio.sleep(0.6)
                await asyncio.to_thread(mesh.kill, "kvstore-0")
                await asyncio.sleep(0.6)
                await asyncio.to_thread(mesh.restart, "kvstore-0")
                return await asyncio.gather(*tasks)
        out = asyncio.run(go())
        got = [o[0] for o in out]
        assert got == reference
        # after the restart the cache fills and hits again
        got2, cached = run_prompts(mesh, prompts[:4])
        assert got2 == reference[:4] and all(c >= 384 for c in cached[1:]), cached


def test_cache_aware_routing_and_metrics(tiny_target, prompts, tiny_tokenizer):
    """Two decode instances, two contexts interleaved: each context sticks to the
    instance that served it first, so its prefix is an L1 hit there."""
    other = shared_prefix_prompts(tiny_tokenizer, n=4, seed=11)
    other = [tiny_tokenizer.encode(inspect.getsource(random))[:400] + p[400:] for p in other]
    ov = det_overrides()
    with Cluster(str(tiny_target), prefill=1, decode=2, **DET, overrides=ov, echo=False) as mesh:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
                seen: dict[int, list[str]] = {0: [], 1: []}
                cached: dict[int, list[int]] = {0: [], 1: []}
                for i in range(4):
                    for ctx, p in ((0, prompts[i]), (1, other[i])):
                        body = {"model": "tiny-target", "prompt": p, "max_tokens": 4,
                                "temperature": 0.0, "pdmesh_path": "pd"}
                        async with http.post(mesh.url + "/v1/completions", json=body) as r:
                            data = await r.json()
                            assert r.status == 200, data
                            seen[ctx].append(r.headers["x-pdmesh-decode"])
                            cached[ctx].append(data["usage"]["prompt_tokens_details"]["cached_tokens"])
                deadline = time.monotonic() + 15     # kvstore's STATS: asked every 2 s
                while True:
                    async with http.get(mesh.url + "/metrics") as r:
                        text = await r.text()
                    if re.search(r"^pdmesh_kvstore_l2_entries [1-9]", text, re.M) \
                            or time.monotonic() > deadline:
                        return seen, cached, text
                    await asyncio.sleep(0.5)
        seen, cached, metrics = asyncio.run(go())
    for ctx in (0, 1):
        assert len(set(seen[ctx])) == 1, seen
        assert all(c >= 384 for c in cached[ctx][1:]), cached
    vals = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
            if line and not line.startswith("#")}
    assert vals["pdmesh_routed_prefix_warm_total"] >= 6
    assert vals["pdmesh_prompt_tokens_cached_total"] >= 6 * 384
    assert "pdmesh_kvstore_l2_bytes" in vals and vals["pdmesh_kvstore_l2_entries"] > 0


def test_selective_write_policy_stores_a_prefix_the_second_time(tiny_target, prompts, reference):
    with _mesh(tiny_target, {}, l1=False, write_policy="write_through_selective") as mesh:
        got, cached = run_prompts(mesh, prompts[:1], seed_first=False)
        time.sleep(1.0)
        assert asyncio.run(micro_stats(mesh.nats_url, "kvstore")).get("blocks_stored", 0) == 0
        got2, _ = run_prompts(mesh, prompts[1:2], seed_first=False)   # same 400-token context
        st = asyncio.run(_stored(mesh.nats_url, 24))
        got3, cached3 = run_prompts(mesh, prompts[2:3], seed_first=False)
    assert got + got2 + got3 == reference[:3]
    assert st["blocks_stored"] == 24 and cached3 == [384]
