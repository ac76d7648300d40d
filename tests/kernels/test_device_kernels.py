"""The kernels on each device: on CUDA the Triton kernels compiled for real (not the
interpreter) against the torch references; on CPU the dispatch takes the references.
`device` is tests/devices.py's fixture: CUDA cases skip without a GPU."""
import math

import pytest
import torch

from kernels.kv_cache import (
    gather_blocks,
    gather_blocks_ref,
    scatter_blocks,
    write_kv,
    write_kv_ref,
)
from kernels.paged_attention import paged_attention_decode, paged_attention_decode_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # real kernels on a real device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_on_device(device, dtype):
    torch.manual_seed(0)
    lens, Hq, Hkv, D, BS = [1, 17, 40, 129], 9, 3, 64, 16
    NB = sum(-(-n // BS) for n in lens) + 2
    perm = torch.randperm(NB, dtype=torch.int32)
    tables = torch.full((len(lens), max(-(-n // BS) for n in lens)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        nb = -(-n // BS)
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    q = torch.randn(len(lens), Hq, D).to(dtype)
    kc, vc = torch.randn(NB, BS, Hkv, D).to(dtype), torch.randn(NB, BS, Hkv, D).to(dtype)
    cl = torch.tensor(lens, dtype=torch.int32)
    want = paged_attention_decode_ref(q, kc, vc, tables, cl, 1 / math.sqrt(D))
    dev = [t.to(device) for t in (q, kc, vc, tables, cl)]
    got = paged_attention_decode(*dev, 1 / math.sqrt(D))
    assert got.device.type == device
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_copies_on_device(device, dtype):
    torch.manual_seed(1)
    NB, BS, Hkv, D, T = 12, 16, 3, 64, 37
    k, v = torch.randn(T, Hkv, D).to(dtype), torch.randn(T, Hkv, D).to(dtype)
    slots = torch.randperm(NB * BS)[:T]
    slots[[0, 5]] = -1
    kc, vc = torch.zeros(NB, BS, Hkv, D, dtype=dtype), torch.zeros(NB, BS, Hkv, D, dtype=dtype)
    kd, vd = kc.to(device), vc.to(device)
    write_kv_ref(k, v, kc, vc, slots)
    write_kv(k.to(device), v.to(device), kd, vd, slots.to(device))
    assert torch.equal(kd.cpu(), kc) and torch.equal(vd.cpu(), vc)
    ids = torch.tensor([7, 2, 11, 0])
    got = gather_blocks(kd, ids.to(device))
    assert torch.equal(got.cpu(), gather_blocks_ref(kc, ids))
    other = torch.zeros_like(kd)
    scatter_blocks(other, ids.to(device), got)
    assert torch.equal(other.cpu()[ids], kc[ids])
