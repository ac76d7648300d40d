"""KV-cache copies: Triton kernels (CPU interpreter on "cpu", compiled on "cuda") and torch
references (on the host) agree exactly."""
import pytest
import torch

from kernels.kv_cache import (
    gather_blocks,
    gather_blocks_ref,
    gather_blocks_triton,
    scatter_blocks,
    scatter_blocks_ref,
    scatter_blocks_triton,
    write_kv,
    write_kv_ref,
    write_kv_triton,
)

DTYPES = [torch.float32, torch.bfloat16]


def make_cache(NB, BS, Hkv, D, dtype):
    return torch.randn(NB, BS, Hkv, D).to(dtype)  # [NB, BS, Hkv, D]


def make_tokens(T, Hkv, D, dtype, device="cpu"):
    """k, v as strided views into one fused projection, the way a model produces them."""
    qkv = torch.randn(T, 3 * Hkv, D).to(dtype).to(device)  # [T, (Hq + 2 Hkv), D] with Hq = Hkv
    return qkv[:, Hkv:2 * Hkv], qkv[:, 2 * Hkv:]


# ---- write_kv --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,D,BS", [(1, 32, 16), (2, 64, 16), (3, 32, 12)])
def test_write_kv_matches_reference(Hkv, D, BS, dtype, device):
    NB, T = 5, 23
    k, v = make_tokens(T, Hkv, D, dtype, device)
    slots = torch.randperm(NB * BS)[:T]
    slots[[0, 7, 22]] = -1  # padding tokens
    k_ref, v_ref = make_cache(NB, BS, Hkv, D, dtype), make_cache(NB, BS, Hkv, D, dtype)
    k_tri, v_tri = k_ref.to(device, copy=True), v_ref.to(device, copy=True)

    write_kv_ref(k.cpu(), v.cpu(), k_ref, v_ref, slots)
    write_kv_triton(k, v, k_tri, v_tri, slots.to(device))
    assert torch.equal(k_tri.cpu(), k_ref) and torch.equal(v_tri.cpu(), v_ref)


def test_write_kv_reference_puts_rows_at_slots_and_skips_padding():
    BS, Hkv, D = 4, 2, 8
    k, v = make_tokens(3, Hkv, D, torch.float32)
    k_cache, v_cache = torch.zeros(3, BS, Hkv, D), torch.zeros(3, BS, Hkv, D)
    write_kv_ref(k, v, k_cache, v_cache, torch.tensor([9, -1, 2]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 2], v[2])
    assert int((k_cache.abs().sum((-1, -2)) > 0).sum()) == 2  # the -1 row went nowhere


def test_write_kv_empty_is_noop(device):
    k, v = make_tokens(0, 2, 32, torch.float32, device)
    cache = make_cache(2, 4, 2, 32, torch.float32).to(device)
    before = cache.clone()
    write_kv_triton(k, v, cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def _write_args(**overrides):
    k, v = make_tokens(4, 2, 32, torch.float32)
    args = dict(k=k, v=v, k_cache=make_cache(3, 4, 2, 32, torch.float32),
                v_cache=make_cache(3, 4, 2, 32, torch.float32), slot_mapping=torch.arange(4))
    args.update({name: fn(args) for name, fn in overrides.items()})
    return args


@pytest.mark.parametrize("overrides,message", [
    (dict(k_cache=lambda a: a["k_cache"][0]), "k_cache must be"),
    (dict(v_cache=lambda a: a["v_cache"][:2]), "v_cache shape"),
    (dict(k=lambda a: torch.randn(4, 3, 32)), "k and v must"),
    (dict(v=lambda a: a["v"][:3]), "k and v must"),
    (dict(slot_mapping=lambda a: a["slot_mapping"].int()), "int64"),
    (dict(slot_mapping=lambda a: a["slot_mapping"][:3]), "slot_mapping must be"),
    (dict(k=lambda a: a["k"].bfloat16()), "dtype mismatch"),
    (dict(k=lambda a: torch.randn(4, 2, 64)[..., ::2]), "stride 1"),
    (dict(slot_mapping=lambda a: torch.arange(8)[::2]), "contiguous"),
    (dict(k=lambda a: a["k"].to("meta")), "different devices"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_write_kv_rejects_bad_inputs(overrides, message):
    with pytest.raises(ValueError, match=message):
        write_kv_triton(**_write_args(**overrides))


# ---- gather_blocks / scatter_blocks -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(16, 2, 64), (12, 3, 32)], ids=["bs16", "bs12_odd_chunk"])
def test_gather_blocks_matches_reference(shape, ids_dtype, dtype, device):
    cache = make_cache(9, *shape, dtype)
    ids = torch.tensor([7, 0, 3, 3, 8], dtype=ids_dtype)  # shuffled, one repeated
    out = gather_blocks_triton(cache.to(device), ids.to(device))
    assert out.is_contiguous() and out.shape == (5, *shape) and out.device.type == device
    out = out.cpu()
    assert torch.equal(out, gather_blocks_ref(cache, ids))
    assert torch.equal(out[1], cache[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 2, 64), (12, 3, 32)], ids=["bs16", "bs12_odd_chunk"])
def test_scatter_blocks_matches_reference(shape, dtype, device):
    ids = torch.tensor([4, 1, 8], dtype=torch.int32)
    data = make_cache(3, *shape, dtype)
    cache_ref = make_cache(9, *shape, dtype)
    cache_tri = cache_ref.to(device, copy=True)
    scatter_blocks_ref(cache_ref, ids, data)
    scatter_blocks_triton(cache_tri, ids.to(device), data.to(device))
    cache_tri = cache_tri.cpu()
    assert torch.equal(cache_tri, cache_ref)
    assert torch.equal(cache_tri[8], data[2])


def test_gather_then_scatter_moves_blocks_between_pools(device):
    """The KV-transfer round trip: prefill pool blocks -> buffer -> other ids in the decode pool."""
    src = make_cache(6, 8, 2, 32, torch.bfloat16).to(device)
    dst = torch.zeros(7, 8, 2, 32, dtype=torch.bfloat16, device=device)
    src_ids, dst_ids = torch.tensor([5, 2, 0], device=device), torch.tensor([1, 6, 3], device=device)
    scatter_blocks_triton(dst, dst_ids, gather_blocks_triton(src, src_ids))
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert int(dst.abs().sum((1, 2, 3)).ne(0).sum()) == 3


def test_empty_block_lists(device):
    cache = make_cache(3, 4, 2, 32, torch.float32).to(device)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    assert gather_blocks_triton(cache, ids).shape == (0, 4, 2, 32)
    scatter_blocks_triton(cache, ids, torch.empty(0, 4, 2, 32, device=device))


@pytest.mark.parametrize("call,message", [
    (lambda c, i: gather_blocks_triton(c[0], i), "cache must be"),
    (lambda c, i: gather_blocks_triton(c, i[None]), "1-D"),
    (lambda c, i: gather_blocks_triton(c, i.float()), "int32 or int64"),
    (lambda c, i: gather_blocks_triton(c, torch.arange(4)[::2]), "block_ids must be contiguous"),
    (lambda c, i: gather_blocks_triton(c.transpose(1, 2), i), "cache must be contiguous"),
    (lambda c, i: gather_blocks_triton(c, i.to("meta")), "different devices"),
    (lambda c, i: scatter_blocks_triton(c, i, c[:1]), "data must be"),
    (lambda c, i: scatter_blocks_triton(c, i, c[:2].bfloat16()), "dtype mismatch"),
    (lambda c, i: scatter_blocks_triton(c, i, c[:2].transpose(1, 2).contiguous().transpose(1, 2)),
     "must be contiguous"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_block_copies_reject_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call(make_cache(4, 4, 2, 32, torch.float32), torch.tensor([2, 0]))


def test_cpu_tensors_need_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA"):
        gather_blocks_triton(make_cache(2, 4, 2, 32, torch.float32), torch.tensor([1]))


def test_dispatch_uses_reference_on_cpu():
    k, v = make_tokens(3, 2, 32, torch.float32)
    k_cache, v_cache = make_cache(2, 4, 2, 32, torch.float32), make_cache(2, 4, 2, 32, torch.float32)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[1, 1], k[0])
    ids = torch.tensor([1])
    blocks = gather_blocks(k_cache, ids)
    scatter_blocks(v_cache, ids, blocks)
    assert torch.equal(v_cache[1], k_cache[1])


def test_interpreted_launch_leaves_triton_language_compiled():
    """Interpreted launches swap triton.language's @jit helpers only for their duration."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    was_compiled = isinstance(tl.sum, JITFunction)
    gather_blocks_triton(make_cache(2, 4, 2, 32, torch.float32), torch.tensor([1]))
    assert isinstance(tl.sum, JITFunction) == was_compiled
    assert tl.sum is tl.standard.sum
