"""A LayerSplit group of real processes around bare engines (no mesh): each rank runs a
script of steps; prompts are prefilled exactly as prefill's job path does it (group
lookup, add_request with the hit, the group's layer-wise load, insert after)."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

from shared.contracts.sampling import SamplingParams


def make_rank(model: str, size: int, rank: int, port: int, cache_mb: float = 4.0,
              delay_s: float = 0.0, load_guard: bool = True, **group):
    from services.prefill.layersplit import LayerSplitConfig, LayerSplitGroup
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, dtype="float32", deterministic=True, threads=1,
                                 num_blocks=256, max_num_batched_tokens=128, chunk_size=32,
                                 block_size=16, prefix_cache=False, load_guard=load_guard))
    cfg = LayerSplitConfig(size=size, rank=rank, addr=f"127.0.0.1:{port}", cache_mb=cache_mb,
                           **group)
    g = LayerSplitGroup(cfg, eng, delay_s=delay_s)
    g.start()
    return eng, g


def wait_ready(g, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not g.ready:
        if time.monotonic() > deadline:
            raise TimeoutError("group did not form")
        time.sleep(0.05)


def prefill(eng, g, prompt: list[int], max_tokens: int = 1) -> tuple[list[int], int]:
    """(greedy tokens, cached tokens) of one prompt, the group's hit loaded layer by layer;
    one token: a prefill-only request whose blocks then go to the group."""
    rid = uuid.uuid4().hex
    tier = g.lookup(eng.prefix_keys(prompt))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    load = eng.add_request(rid, prompt, sp, prefill_only=max_tokens == 1, tier_blocks=tier)
    if load is not None:
        threading.Thread(target=lambda: asyncio.run(g.load(eng, load)), daemon=True).start()
    tokens, cached = [], 0
    while eng.has_unfinished:
        for o in eng.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    if max_tokens == 1:
        g.insert(eng, *eng.port.computed_prompt_blocks(rid))
        eng.release(rid)
    return tokens, cached


def settle(g, timeout: float = 10.0) -> None:
    """Wait until this rank's queued inserts went out."""
    deadline = time.monotonic() + timeout
    while g.inserts.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.02)
