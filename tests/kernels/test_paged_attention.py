"""Paged-attention decode: Triton kernel (CPU interpreter on "cpu", compiled on "cuda") and
torch reference agree. Cases are made on the host; the kernel gets them `on` its device."""
import math

import pytest
import torch

from kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


def make_case(lens, Hq, Hkv, D, BS, dtype, spare_blocks=3, pad_cols=1):
    """Random q and cache; each sequence owns shuffled blocks; table padding is -1."""
    nbs = [-(-n // BS) for n in lens]
    NB = sum(nbs) + spare_blocks
    perm = torch.randperm(NB, dtype=torch.int32)
    B, max_blocks = len(lens), max(nbs, default=0) + pad_cols
    block_tables = torch.full((B, max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(nbs):
        block_tables[b, :n] = perm[start:start + n]
        start += n
    q = torch.randn(B, Hq, D).to(dtype)  # [B, Hq, D]
    k_cache = torch.randn(NB, BS, Hkv, D).to(dtype)  # [NB, BS, Hkv, D]
    v_cache = torch.randn(NB, BS, Hkv, D).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens, 1.0 / math.sqrt(D)


def on(device, case):
    """The case's tensors on the device (the scale stays a float)."""
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in case)


def naive_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Token by token through the block table, the slow obvious way."""
    B, Hq, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, Hq, D)
    for b in range(B):
        n = int(context_lens[b])
        if n == 0:
            continue
        blocks = [int(block_tables[b, p // BS]) for p in range(n)]
        k = torch.stack([k_cache[blk, p % BS] for p, blk in enumerate(blocks)]).float()  # [n, Hkv, D]
        v = torch.stack([v_cache[blk, p % BS] for p, blk in enumerate(blocks)]).float()
        for h in range(Hq):
            kv_h = h // (Hq // Hkv)
            probs = torch.softmax(k[:, kv_h] @ q[b, h].float() * scale, dim=0)  # [n]
            out[b, h] = probs @ v[:, kv_h]
    return out.to(q.dtype)


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (8, 2)])  # GQA ratio 1, 2, 4
@pytest.mark.parametrize("lens", [[37], [1, 16, 17, 40, 5]], ids=["one_seq", "many_seqs"])
def test_triton_matches_reference(lens, Hq, Hkv, D, dtype, device):
    case = make_case(lens, Hq, Hkv, D, BS=16, dtype=dtype)
    assert_close(paged_attention_decode_triton(*on(device, case)), paged_attention_decode_ref(*case), dtype)


@pytest.mark.parametrize("BS,D", [(12, 48), (1, 32), (32, 80)], ids=["bs12_d48", "bs1", "bs32_d80"])
def test_block_size_and_head_dim_not_powers_of_two(BS, D, device):
    case = make_case([25, 3], Hq=6, Hkv=2, D=D, BS=BS, dtype=torch.float32)  # GQA ratio 3
    assert_close(paged_attention_decode_triton(*on(device, case)), paged_attention_decode_ref(*case), torch.float32)


def test_float16(device):
    case = make_case([19, 33], Hq=4, Hkv=1, D=32, BS=8, dtype=torch.float16)
    assert_close(paged_attention_decode_triton(*on(device, case)), paged_attention_decode_ref(*case), torch.float16)


def test_strided_q_and_block_tables(device):
    q, k_cache, v_cache, block_tables, context_lens, scale = make_case([30, 9], 4, 2, 32, 8, torch.float32)
    nb = block_tables.shape[1]
    qkv = torch.randn(2, 8, 32)
    qkv[:, :4] = q
    wide_tables = torch.full((2, 10), -1, dtype=torch.int32)
    wide_tables[:, :nb] = block_tables
    expected = paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    qkv, wide_tables = qkv.to(device), wide_tables.to(device)   # views after the move: `.to` compacts
    q_view, tables_view = qkv[:, :4], wide_tables[:, :nb]  # row strides > width
    assert not q_view.is_contiguous() and not tables_view.is_contiguous()
    k_cache, v_cache, context_lens = on(device, (k_cache, v_cache, context_lens))
    strided = (q_view, k_cache, v_cache, tables_view, context_lens, scale)
    assert_close(paged_attention_decode_triton(*strided), expected, torch.float32)
    assert_close(paged_attention_decode_ref(*strided), expected, torch.float32)


def test_empty_context_gives_zeros(device):
    case = make_case([0, 7, 0], Hq=4, Hkv=2, D=32, BS=4, dtype=torch.float32)
    ref = paged_attention_decode_ref(*case)
    assert torch.all(ref[0] == 0) and torch.all(ref[2] == 0)
    assert_close(paged_attention_decode_triton(*on(device, case)), ref, torch.float32)


def test_empty_batch(device):
    case = make_case([], Hq=4, Hkv=2, D=32, BS=4, dtype=torch.float32)
    assert paged_attention_decode_triton(*on(device, case)).shape == (0, 4, 32)
    assert paged_attention_decode_ref(*case).shape == (0, 4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (8, 2)])
def test_reference_matches_naive_attention(Hq, Hkv, dtype):
    case = make_case([1, 16, 17, 50, 0], Hq, Hkv, D=32, BS=16, dtype=dtype)
    assert_close(paged_attention_decode_ref(*case), naive_attention(*case), dtype)


def test_dispatch_on_cpu_is_the_cpp_op_or_else_the_reference(monkeypatch):
    import kernels.cpu_ops.build as build

    case = make_case([20, 4], Hq=4, Hkv=2, D=32, BS=8, dtype=torch.float32)
    ref = paged_attention_decode_ref(*case)
    got = paged_attention_decode(*case)           # C++ (kernels/cpu_ops): close, not equal
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setitem(build._cache, "mod", None)  # the extension off: the reference itself
    assert torch.equal(paged_attention_decode(*case), ref)


def _bad(**overrides):
    q, k, v, bt, lens, scale = make_case([10, 3], Hq=4, Hkv=2, D=32, BS=8, dtype=torch.float32)
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, context_lens=lens, scale=scale)
    args.update({name: fn(args) for name, fn in overrides.items()})
    return args


@pytest.mark.parametrize("overrides,message", [
    (dict(q=lambda a: a["q"][0]), "q must be"),
    (dict(k_cache=lambda a: a["k_cache"][0]), "k_cache must be"),
    (dict(v_cache=lambda a: a["v_cache"][:, :4]), "v_cache shape"),
    (dict(q=lambda a: torch.randn(2, 4, 16)), "head_dim mismatch"),
    (dict(q=lambda a: torch.randn(2, 3, 32)), "multiple of Hkv"),
    (dict(block_tables=lambda a: a["block_tables"][:1]), "block_tables must be"),
    (dict(context_lens=lambda a: a["context_lens"][None]), "context_lens must be"),
    (dict(q=lambda a: a["q"].double()), "not supported"),
    (dict(k_cache=lambda a: a["k_cache"].bfloat16()), "dtype mismatch"),
    (dict(block_tables=lambda a: a["block_tables"].long()), "int32"),
    (dict(context_lens=lambda a: a["context_lens"].long()), "int32"),
    (dict(q=lambda a: torch.randn(2, 4, 64)[..., ::2]), "stride 1"),
    (dict(v_cache=lambda a: a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)), "strides differ"),
    (dict(q=lambda a: a["q"].to("meta")), "different devices"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_host_function_rejects_bad_inputs(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_attention_decode_triton(**_bad(**overrides))


def test_cpu_tensors_need_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA"):
        paged_attention_decode_triton(**_bad())
