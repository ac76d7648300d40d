"""The KV wire's C++ copies (kernels/cpu_ops/kv_copy.cpp) give the bytes, the pool contents
that the torch path gives, and refuse what it refuses: a block id
or a layer outside the pool, a payload of the wrong size, a strided buffer."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.cpu_ops import load
from shared.kv import wire

pytestmark = pytest.mark.skipif(load() is None, reason="C++ CPU ops not built")


@pytest.fixture
def torch_path(monkeypatch):
    """Run the wire without the extension (as on a machine without a compiler)."""
    def use(off: bool):
        monkeypatch.setattr(wire, "_mod", [None] if off else [load()])
    return use


def pool(NB=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 2, NB, 4, 3, 8, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_and_scatter_match_the_torch_path(dtype, torch_path):
    rng = random.Random(1)
    src = pool(dtype=dtype)
    for _ in range(30):
        blocks = rng.sample(range(40), rng.randint(1, 9))
        l0 = rng.randrange(6)
        l1 = rng.randint(l0 + 1, 6)
        got = {}
        for off in (False, True):
            torch_path(off)
            payload, shape = wire.pack(src, blocks, l0, l1)
            dst = torch.zeros_like(src)
            wire.unpack_into(dst, blocks, l0, l1, payload, wire.dtype_name(dtype), shape)
            got[off] = bytes(payload), dst
        assert got[False][0] == got[True][0]
        assert torch.equal(got[False][1], got[True][1])
        assert torch.equal(got[False][1][l0:l1, :, blocks], src[l0:l1, :, blocks])


def test_gather_into_a_given_buffer(torch_path):
    src = pool()
    n = wire.piece_bytes(src, 3, 1, 4)
    out = memoryview(bytearray(n))
    payload, _ = wire.pack(src, [5, 0, 39], 1, 4, out=out)
    assert payload is out
    assert bytes(out) == src[1:4][:, :, [5, 0, 39]].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("off", [False, True], ids=["cpp", "torch"])
def test_writes_outside_the_pool_are_refused_alike_on_both_paths(off, torch_path):
    """A write's block ids and layers come from the bus: both paths refuse the same ones with
    a ValueError (decode answers INVALID_REQUEST), where torch alone would wrap a negative
    layer into the wrong layers and apply an empty layer range as a no-op."""
    src = pool()
    payload, shape = wire.pack(src, [1, 2], 0, 6)
    torch_path(off)
    for blocks in ([40, 2], [-1, 2]):
        with pytest.raises(ValueError, match="block id outside"):
            wire.pack(src, blocks, 0, 6)
        with pytest.raises(ValueError, match="block id outside"):
            wire.unpack_into(src.clone(), blocks, 0, 6, payload, "bfloat16", shape)
    for l0, l1 in ((-4, 2), (3, 3), (5, 7)):
        dst = src.clone()
        with pytest.raises(ValueError, match="layers"):
            wire.unpack_into(dst, [1, 2], l0, l1, payload[:0] if l0 == l1 else payload,
                             "bfloat16", [l1 - l0, 2, 2, 4, 3, 8])
        assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="does not fit"):
        wire.unpack_into(src.clone(), [1, 2], 0, 6, payload[:-2], "bfloat16", shape)
    with pytest.raises(ValueError, match="not one contiguous"):
        wire.unpack_into(src.clone(), [1, 2], 0, 6, memoryview(bytes(payload) * 2)[::2],
                         "bfloat16", shape)


def test_the_extension_refuses_sizes_ranges_and_strided_buffers():
    """The C++ checks behind the Python ones: a flat memcpy of a strided view would read or
    write past it."""
    ext, src = load(), pool()
    payload, _ = wire.pack(src, [1, 2], 0, 6)
    with pytest.raises(RuntimeError, match="payload of"):
        ext.kv_gather(src, [1, 2], 0, 6, memoryview(bytearray(len(payload) - 2)))
    with pytest.raises(RuntimeError, match="layers out of range"):
        ext.kv_scatter(src, [1, 2], 5, 7, payload)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ext.kv_scatter(src, [1, 40], 0, 6, payload)
    wide = bytearray(2 * len(payload))
    with pytest.raises(RuntimeError, match="not contiguous"):
        ext.kv_scatter(src, [1, 2], 0, 6, memoryview(wide)[::2])
    with pytest.raises(RuntimeError, match="not contiguous"):
        ext.kv_gather(src, [1, 2], 0, 6, memoryview(wide)[::2])
