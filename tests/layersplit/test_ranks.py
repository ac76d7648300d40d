"""LayerSplit on bare engines, each rank a real process joined by torch.distributed (gloo):
per-rank cache memory is 1/N of the unsplit layout for the same cached prefixes (measured:
the bytes each rank's store holds for them), each rank holds exactly its layers' KV;
slow transfers (TEST ONLY delay) still give the same tokens, and with the readiness guard
off they do not."""
from __future__ import annotations

import multiprocessing as mp
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdmesh.local.launch import free_port

from .ranks import make_rank, prefill, settle, wait_ready

MODEL = "models/tiny-target"


def contexts(n: int = 3, ctx: int = 200, tail: int = 20, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 8000) for _ in range(ctx)]
    return [base + [rng.randrange(3, 8000) for _ in range(tail * (i + 1))] for i in range(n)]


def held(g) -> tuple[int, dict[bytes, list[float]]]:
    """Measured: the bytes of this rank's store that hold cached blocks, and per key the
    sum of each owned layer's KV (to compare with the unsplit store's)."""
    sh = g.shard
    slots = [s for s, k in enumerate(sh.slot_key) if k is not None]
    data = sh.kv[:, :, torch.tensor(slots, dtype=torch.long)]       # a real copy
    sums = {sh.slot_key[s]: [float(data[j, :, i].double().sum()) for j in range(len(sh.owned))]
            for i, s in enumerate(slots)}
    return data.numel() * data.element_size(), sums


def _store_worker(rank: int, size: int, port: int, filled, out) -> None:
    eng, g = make_rank(MODEL, size, rank, port)
    wait_ready(g)
    if rank == 0:
        for p in contexts():
            prefill(eng, g, p)
        settle(g)           # every insert went out (and was taken by its receiver)
        filled.set()
    filled.wait(60)
    time.sleep(0.5)
    nbytes, sums = held(g)
    out.put((rank, nbytes, {k.hex(): v for k, v in sums.items()}, g.shard.owned))
    time.sleep(2.0)


def _run(target, size: int, *args, timeout: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    q, filled = ctx.Queue(), ctx.Event()
    port = free_port()
    ps = [ctx.Process(target=target, args=(r, size, port, *args, filled, q))
          for r in range(size)]
    for p in ps:
        p.start()
    res = []
    try:
        while len(res) < size:
            item = q.get(timeout=timeout)
            if item[0] != "filled":
                res.append(item)
    finally:
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()
    return sorted(res, key=lambda r: r[0])


def test_per_rank_memory_is_one_nth_of_unsplit():
    (_, unsplit, whole, layers), = _run(_store_worker, 1)
    split = _run(_store_worker, 2)
    assert unsplit > 0 and layers == list(range(6))
    for rank, nbytes, sums, owned in split:
        assert owned == list(range(rank, 6, 2))
        assert nbytes * 2 == unsplit, (rank, nbytes, unsplit)          # measured: 1/N
        assert set(sums) == set(whole)                                   # the same prefixes
        for k, v in sums.items():
            assert v == [whole[k][layer] for layer in owned]             # its layers' KV only


def _slow_worker(rank: int, size: int, port: int, delay_s: float, guard: bool, model: str,
                 filled, out) -> None:
    eng, g = make_rank(model, size, rank, port, delay_s=delay_s if rank == 1 else 0.0,
                       load_guard=guard if rank == 1 else True)
    wait_ready(g)
    ps = contexts(n=2)
    if rank == 0:
        prefill(eng, g, ps[0])
        settle(g)
        out.put(("filled", 0))
        filled.wait(30)                          # rank 1 is done with this rank's layers
        out.put((0, None, None))
        return
    deadline = time.monotonic() + 20
    while g.lookup(eng.prefix_keys(ps[1])) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    hit = prefill(eng, g, ps[1], max_tokens=8)
    g.lookup = lambda keys: 0                    # the same prompt computed, no cache
    ref = prefill(eng, g, ps[1], max_tokens=8)
    filled.set()
    out.put((1, hit, ref))


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no_guard"])
def test_slow_transfers_wait_and_without_the_guard_go_wrong(guard):
    _, (_, (hit, cached), (ref, _)) = _run(_slow_worker, 2, 0.3, guard, MODEL)
    assert cached > 0
    if guard:
        assert hit == ref
    else:
        assert hit != ref, "read before the layers landed, yet the same tokens"


ARCHS = {       # tests/engine/test_archs.py's shapes, with the contexts' vocabulary and a
                # window that reaches back into the cached prefix (rank 0 holds the local layers)
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    sliding_window=48, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                                    pad_token_id=0)),
    "glm4": ("Glm4Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                attention_bias=True, pad_token_id=0, eos_token_id=0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_other_architectures_split_their_layers_and_answer_the_same(arch, tmp_path):
    """A windowed, soft-capped (Gemma 2), a partial-RoPE post-norm (GLM-4) and a sparse
    (Qwen3-MoE) model: rank 1 loads rank 0's layers of a cached prefix and continues
    greedily exactly as computing the prompt itself."""
    from tests.engine.test_archs import checkpoint

    cls, fields = ARCHS[arch]
    path = checkpoint(tmp_path / arch, cls, vocab_size=8192, num_hidden_layers=4,
                      max_position_embeddings=1024, **fields)
    for f in ("tokenizer.json", "tokenizer_config.json"):      # the tiny model's (8192)
        shutil.copy(Path(MODEL) / f, path / f)
    _, (_, (hit, cached), (ref, _)) = _run(_slow_worker, 2, 0.0, True, str(path))
    assert cached > 0 and len(hit) == 8
    assert hit == ref


def _host_worker(rank: int, size: int, port: int, filled, out) -> None:
    """Rank 0 (it hosts the rendezvous store): fill the group, then live until killed."""
    eng, g = make_rank(MODEL, size, rank, port)
    wait_ready(g, 60)
    prefill(eng, g, contexts(n=2)[0])
    settle(g)
    filled.set()
    time.sleep(120)


def _until(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError
        time.sleep(0.05)
    return time.monotonic() - t0


def _survivor(rank: int, size: int, port: int, filled, killed, refilled, out) -> None:
    eng, g = make_rank(MODEL, size, rank, port)
    ps = contexts(n=2)
    keys = eng.prefix_keys(ps[1])
    wait_ready(g, 60)
    filled.wait(60)
    _until(lambda: g.lookup(keys) > 0, 20)
    before = prefill(eng, g, ps[1], max_tokens=4)
    out.put(("hit", before))
    killed.wait(60)
    lost_after = _until(lambda: not g.ready, 20)
    alone = prefill(eng, g, ps[1], max_tokens=4)
    rejoined_after = _until(lambda: g.ready, 60)
    refilled.wait(60)
    _until(lambda: g.lookup(keys) > 0, 20)
    again = prefill(eng, g, ps[1], max_tokens=4)
    out.put(("done", lost_after, alone, rejoined_after, again, g.stats()["group_lost_blocks"]))


def test_store_host_dies_and_restarts():
    """Rank 0 (the rendezvous store's host) SIGKILLed: rank 1 leaves the group, drops the
    entries and computes alone, correctly and without hanging; rank 0 restarted: the group
    re-forms and hits again."""
    ctx = mp.get_context("spawn")
    q, filled, killed, refilled = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    port = free_port()
    host = ctx.Process(target=_host_worker, args=(0, 2, port, filled, q))
    surv = ctx.Process(target=_survivor, args=(1, 2, port, filled, killed, refilled, q))
    host.start()
    surv.start()
    try:
        _, (hit, cached) = q.get(timeout=120)
        host.kill()
        host.join(10)
        killed.set()
        host = ctx.Process(target=_host_worker, args=(0, 2, port, refilled, q))
        host.start()
        _, lost_after, (alone, alone_cached), rejoined_after, (again, again_cached), lost = \
            q.get(timeout=180)
    finally:
        for p in (host, surv):
            p.kill()
            p.join(10)
    assert cached > 0 and alone_cached == 0 and again_cached > 0
    assert hit == alone == again
    assert lost_after < 20 and lost > 0
