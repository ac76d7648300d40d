"""The KV wire (shared/kv/wire.py): every piece fits the payload limit, pack -> unpack moves
exactly the right blocks and layers into another pool in both layouts (prefill -> decode
writes; kvstore puts and layer pulls), and a corrupted byte is caught by the checksum."""
from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch

from shared.kv import wire
from shared.kv.wire import pack, plan, unpack_into


def pool(L=5, NB=12, BS=4, H=2, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)


# ---- write layout (prefill -> decode) ----------------------------------------------------

@pytest.mark.parametrize("max_bytes", [10_000, 3_000, 600, 520])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_pack_unpack_roundtrip(max_bytes, dtype):
    src, dst = pool(dtype=dtype), torch.zeros(5, 2, 12, 4, 2, 8, dtype=dtype)
    src_blocks, dst_blocks = [7, 2, 9, 0, 5], [1, 11, 3, 4, 8]
    pieces = plan(len(src_blocks), src, max_bytes)
    covered = set()
    for p in pieces:
        payload, shape = pack(src, src_blocks[p.b0:p.b1], p.l0, p.l1)
        assert len(payload) <= max_bytes
        unpack_into(dst, dst_blocks[p.b0:p.b1], p.l0, p.l1, payload,
                    {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], shape)
        covered |= {(b, l) for b in range(p.b0, p.b1) for l in range(p.l0, p.l1)}
    assert covered == {(b, l) for b in range(5) for l in range(5)}
    assert torch.equal(dst[:, :, dst_blocks], src[:, :, src_blocks])
    untouched = [b for b in range(12) if b not in dst_blocks]
    assert dst[:, :, untouched].abs().sum() == 0


def test_plan_sizes():
    kv = pool()                                   # one layer of one block: 2*4*2*8*4 = 512 B
    assert wire.layer_bytes(kv) == 512
    # whole blocks (5 layers = 2560 B) when they fit: 3 per write, 7 blocks -> 3 + 3 + 1
    assert [(p.b0, p.b1, p.l0, p.l1) for p in plan(7, kv, 8000)] == [
        (0, 3, 0, 5), (3, 6, 0, 5), (6, 7, 0, 5)]
    # else layer slices of one block: 2 layers per write -> 0..2, 2..4, 4..5 per block
    pieces = plan(2, kv, 1100)
    assert [(p.b0, p.l0, p.l1) for p in pieces] == [
        (0, 0, 2), (0, 2, 4), (0, 4, 5), (1, 0, 2), (1, 2, 4), (1, 4, 5)]
    assert [p.index for p in pieces] == list(range(6))


def test_pack_layout_is_kv_slice_of_the_blocks():
    kv = pool(dtype=torch.bfloat16)
    payload, shape = pack(kv, [3, 0, 8], 1, 4)
    want = kv[1:4][:, :, [3, 0, 8]].contiguous()
    assert shape == [3, 2, 3, 4, 2, 8] == list(want.shape)
    assert bytes(payload) == want.view(torch.uint8).numpy().tobytes()
    assert wire.checksum(payload) == zlib.crc32(bytes(payload))


def test_payload_that_does_not_fit_the_pool_is_refused():
    src, dst = pool(), pool(D=4)
    payload, shape = pack(src, [0], 0, 5)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_into(dst, [0], 0, 5, payload, "float32", shape)
    with pytest.raises(ValueError, match="does not fit"):      # right shape, wrong dtype
        unpack_into(pool(), [0], 0, 5, payload, "bfloat16", shape)
    with pytest.raises(ValueError, match="does not fit"):      # truncated payload
        unpack_into(pool(), [0], 0, 5, bytes(payload)[:-4], "float32", shape)


def test_block_layer_larger_than_payload_is_refused():
    with pytest.raises(ValueError, match="max payload"):
        plan(3, pool(), 100)


def test_dtype_names():
    assert [wire.dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [
        "float32", "bfloat16", "float16"]
    with pytest.raises(ValueError):
        wire.dtype_name(torch.int8)


# ---- block layout (engine <-> kvstore) ---------------------------------------------------

@pytest.mark.parametrize("max_bytes", [100_000, 6_000, 2_560, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_then_layer_pulls_roundtrip(max_bytes, dtype):
    src, dst = pool(dtype=dtype, seed=1), torch.zeros(5, 2, 12, 4, 2, 8, dtype=dtype)
    src_blocks, dst_blocks = [4, 10, 1, 6], [0, 9, 2, 7]
    L, lb, n = 5, wire.layer_bytes(src), len(src_blocks)
    snap = wire.snapshot_blocks(src, src_blocks)
    assert torch.equal(snap, src[:, :, src_blocks].permute(2, 0, 1, 3, 4, 5))
    src.zero_()                                   # the snapshot is a copy
    # write-back: puts of whole blocks, each within max_bytes (at least one block each)
    store = []
    puts = wire.plan_puts(n, L, lb, max_bytes)
    assert [b for r in puts for b in range(*r)] == list(range(n))
    for b0, b1 in puts:
        payload, sums = wire.pack_put(snap, b0, b1)
        assert len(payload) == (b1 - b0) * L * lb and (b1 - b0 == 1 or len(payload) <= max_bytes)
        assert len(sums) == b1 - b0 and all(len(s) == L for s in sums)
        got = wire.unpack_put(bytes(payload), b1 - b0, L, lb, sums)
        assert [i for i, _, _ in got] == list(range(b1 - b0))
        store += [(layers, s) for _, layers, s in got]
    # load: layer pulls, layer 0 first, each landing in the destination blocks
    pulls = wire.plan_pulls(n, L, lb, max_bytes)
    assert [l for l, _, _ in pulls] == sorted(l for l, _, _ in pulls)
    for l, b0, b1 in pulls:
        data, headers = wire.pack_layer([store[i][0][l] for i in range(b0, b1)],
                                        [store[i][1][l] for i in range(b0, b1)])
        assert b1 - b0 == 1 or len(data) <= max_bytes
        t = wire.unpack_layer(data, headers, dst, b1 - b0)
        assert list(t.shape) == [2, b1 - b0, 4, 2, 8]
        dst[l, :, dst_blocks[b0:b1]] = t
    assert torch.equal(dst[:, :, dst_blocks], snap.permute(1, 2, 0, 3, 4, 5))


def test_put_block_with_a_bad_layer_is_left_out():
    snap = wire.snapshot_blocks(pool(), [0, 1, 2])
    payload, sums = wire.pack_put(snap, 0, 3)
    lb = wire.layer_bytes(pool())
    bad = bytearray(payload)
    bad[1 * 5 * lb + 3 * lb + 7] ^= 0x10           # block 1, layer 3
    got = wire.unpack_put(bad, 3, 5, lb, sums)
    assert [i for i, _, _ in got] == [0, 2]
    sums[2] = sums[2][:4]                          # a block with a checksum missing
    assert [i for i, _, _ in wire.unpack_put(payload, 3, 5, lb, sums)] == [0, 1]
    with pytest.raises(ValueError, match="bytes for 3 blocks"):
        wire.unpack_put(bytes(payload)[:-1], 3, 5, lb, sums)
    with pytest.raises(ValueError):
        wire.unpack_put(payload, 3, 5, lb, sums[:2])


def test_layer_pull_checksum_mismatch_is_detected():
    kv = pool()
    snap = wire.snapshot_blocks(kv, [5, 6])
    payload, sums = wire.pack_put(snap, 0, 2)
    blocks = wire.unpack_put(payload, 2, 5, 512, sums)       # (index, layers, sums)
    data, headers = wire.pack_layer([b[1][2] for b in blocks], [b[2][2] for b in blocks])
    wire.unpack_layer(data, headers, kv, 2)
    bad = bytearray(data)
    bad[600] ^= 1
    with pytest.raises(wire.ChecksumError):
        wire.unpack_layer(bytes(bad), headers, kv, 2)
    with pytest.raises(wire.ChecksumError):       # a block short
        wire.unpack_layer(data[:512], headers, kv, 2)
    with pytest.raises(ValueError) as e:          # no checksums at all: not a mismatch
        wire.unpack_layer(data, {}, kv, 2)
    assert not isinstance(e.value, wire.ChecksumError)


def test_kvstore_side_does_not_load_torch():
    code = ("import sys, services.kvstore.service, shared.kv.wire; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_write_digest_covers_every_header_field_and_every_byte():
    """KvWrite.digest binds the payload to its header: moving the bytes to other blocks,
    epochs, layers, another request or attempt, or changing the PrefillDone a write
    carries, changes it, and so does any change of the bytes, including the two opposite
    sign-bit flips that cancelled out in the linear checksum it replaced."""
    import msgspec

    from shared.contracts.kv import KvWrite
    from shared.contracts.messages import PrefillDone, PrefillStatus

    payload = bytearray(torch.randn(1024, generator=torch.Generator().manual_seed(0))
                        .numpy().tobytes())
    meta = KvWrite(request_id="r", epochs=[11, 12], block_ids=[3, 4], layer_start=0,
                   layer_end=2, dtype="float32", shape=[2, 2, 2, 16, 2, 2], seq=0,
                   sender="p", attempt="a")
    base = wire.write_digest(meta, payload)
    assert len(base) == 32 and wire.signed(meta, payload).digest == base
    done = PrefillDone(request_id="r", prefill_instance="p", status=PrefillStatus.OK,
                       first_token=7, writes_issued=1)
    for change in ({"request_id": "s"}, {"epochs": [11, 13]}, {"block_ids": [4, 3]},
                   {"layer_start": 1}, {"layer_end": 1}, {"shape": [2, 2, 2, 16, 1, 4]},
                   {"seq": 1}, {"sender": "q"}, {"attempt": "b"}, {"dtype": "bfloat16"},
                   {"done": done}):
        assert wire.write_digest(msgspec.structs.replace(meta, **change), payload) != base, change
    assert wire.write_digest(msgspec.structs.replace(meta, digest="x"), payload) == base
    flipped = bytearray(payload)
    flipped[7] ^= 0x80           # the sign bit of the first 8-byte word
    flipped[15] ^= 0x80          # and of the second: a linear sum mod 2^64 is unchanged
    assert wire.write_digest(meta, flipped) != base
    assert wire.write_digest(meta, payload[:-1]) != base
