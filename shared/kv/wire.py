"""The KV wire: how KV blocks become message payloads and back, for every KV wire in pdmesh.

A checksum and a digest (crc32 of raw bytes for kvstore; write_digest(), BLAKE3 over a
prefill -> decode write's header fields and payload), one header room, two payload layouts:

  write layout   prefill -> decode (KvWrite): kv[l0:l1, :, blocks] of the sender's pool,
                 C-contiguous, shape [l1 - l0, 2, n, block_size, Hkv, D]. plan() sizes the
                 writes: whole blocks (all layers) when they fit, else layer slices of one
                 block; pack() / unpack_into() move them.
  block layout   engine <-> kvstore: per block its layers in order, each layer K then V,
                 [n, L, 2, block_size, Hkv, D]. A put (write-back) carries whole blocks
                 (plan_puts, pack_put / unpack_put, one checksum per layer of each block);
                 a layer pull carries one layer of a run of blocks, [n, 2, block_size,
                 Hkv, D] (plan_pulls, pack_layer / unpack_layer, the stored checksums in
                 the LAYER_SUMS header).

Payloads are handed out as flat memoryviews over one contiguous buffer (no copy after the
gather) and read in place by the scatter. On a CPU pool the gather and the scatter run in
C++ (kernels/cpu_ops/kv_copy.cpp: row memcpys, ~6x torch's index_copy_); without the
extension, torch's index_select / index_copy_ give the same bytes. torch is imported
only by the functions that need it: kvstore uses the byte-level half without loading torch.
"""
from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Room left for NATS headers below the server's max_payload (which counts headers too):
# a KvWrite's block ids and epochs, a put's keys and per-layer checksums.
HEADER_ROOM = 64 << 10
LAYER_SUMS = "Pdmesh-checksums"     # header of a layer-pull reply: json list, one per block
DTYPE_NAMES = ("float32", "bfloat16", "float16")

Buffer = bytes | bytearray | memoryview


class ChecksumError(ValueError):
    """Received KV bytes do not match their checksum (or their announced size)."""


def checksum(data: Buffer) -> int:
    """The checksum of KV bytes to and from kvstore: crc32 (stdlib, fast)."""
    return zlib.crc32(data)


def _ext():
    """The C++ ops (kernels/cpu_ops: kv_gather, kv_scatter), or None. The engine loads them
    when it makes its KV pool (model.kv_pool)."""
    mod = _mod[0]
    if mod is False:
        try:
            from kernels.cpu_ops.build import load
        except ImportError:
            mod = None
        else:
            mod = load()
        _mod[0] = mod
    return mod


_mod: list = [False]       # tests set [None] to run the torch path

DIGEST_BYTES = 16


def write_digest(meta, data: Buffer) -> str:
    """The digest of a prefill -> decode KV write (KvWrite.digest): BLAKE3, 128 bits, over
    the write's every header field (request, attempt, sender, seq, block ids, epochs,
    layers, dtype, shape, the PrefillDone it carries) and its payload. A cryptographic
    hash: no flipped bits cancel out (the linear sum it replaces let two sign flips
    through), and bytes cannot be moved to other blocks, layers or requests under the
    same digest. BLAKE3 (the reference implementation's Python binding) runs at ~6 GB/s
    on one core here, SHA-256 at ~1.6 and BLAKE2b at ~1: on a 150 MB/s NATS path it
    costs ~5% where SHA-256 cost ~20%."""
    import blake3
    import msgspec
    head = msgspec.json.encode(msgspec.structs.replace(meta, digest=""))
    h = blake3.blake3(len(head).to_bytes(8, "little"))
    h.update(head)
    h.update(data)
    return h.digest(DIGEST_BYTES).hex()


def signed(meta, data: Buffer):
    """meta with its digest over data filled in."""
    import msgspec
    return msgspec.structs.replace(meta, digest=write_digest(meta, data))


OFFLOAD_BYTES = 1 << 20     # a digest over more bytes than this runs off the loop


async def digest_async(meta, data: Buffer) -> str:
    """write_digest() without holding the event loop for a large payload (blake3 drops
    the GIL: a worker thread hashes while the loop serves other writes)."""
    if len(data) < OFFLOAD_BYTES:
        return write_digest(meta, data)
    import asyncio
    return await asyncio.get_running_loop().run_in_executor(None, write_digest, meta, data)


def write_bytes(meta) -> int:
    """The payload size a KvWrite's shape and dtype announce (ValueError: unknown dtype
    or a bad shape)."""
    if meta.dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown KV dtype {meta.dtype!r}")
    if len(meta.shape) != 6 or any(d < 0 for d in meta.shape):
        raise ValueError(f"bad KV write shape {meta.shape}")
    n = 4 if meta.dtype == "float32" else 2
    for d in meta.shape:
        n *= d
    return n


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} is not one of {DTYPE_NAMES}")
    return name


def layer_bytes(kv: torch.Tensor) -> int:
    """Bytes of one layer of one block (K and V) of a pool [L, 2, NB, BS, Hkv, D]."""
    return 2 * kv.shape[3] * kv.shape[4] * kv.shape[5] * kv.element_size()


def _flat(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    import torch
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _view(data: Buffer, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Bytes as a tensor of `shape`, without a copy (read only)."""
    import torch
    with warnings.catch_warnings():     # a received payload is read-only; we only read it
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        t = torch.frombuffer(data, dtype=torch.uint8)
    return t.view(dtype).view(*shape)


# ---- write layout: prefill -> decode -----------------------------------------------------

@dataclass(frozen=True, slots=True)
class Piece:
    index: int            # positions in the request's block list: [b0, b1)
    b0: int
    b1: int
    l0: int               # layers [l0, l1)
    l1: int


def plan(num_blocks: int, kv: torch.Tensor, max_bytes: int) -> list[Piece]:
    """Split a request's blocks x layers into writes of at most max_bytes."""
    L = kv.shape[0]
    lb = layer_bytes(kv)
    if lb > max_bytes:
        raise ValueError(f"one layer of one KV block is {lb} bytes > max payload {max_bytes}")
    pieces: list[Piece] = []
    if L * lb <= max_bytes:
        per = max_bytes // (L * lb)
        for b0 in range(0, num_blocks, per):
            pieces.append(Piece(len(pieces), b0, min(num_blocks, b0 + per), 0, L))
    else:
        per = max_bytes // lb
        for b in range(num_blocks):
            for l0 in range(0, L, per):
                pieces.append(Piece(len(pieces), b, b + 1, l0, min(L, l0 + per)))
    return pieces


def piece_bytes(kv: torch.Tensor, num_blocks: int, l0: int, l1: int) -> int:
    """Bytes of a write of num_blocks blocks x layers [l0, l1)."""
    return layer_bytes(kv) * num_blocks * (l1 - l0)


def check_range(kv: torch.Tensor, blocks: Sequence[int], l0: int, l1: int) -> None:
    """A write's layers and blocks lie inside this pool (ValueError otherwise: the same
    refusal on the C++ and the torch path, where torch would wrap a negative layer)."""
    if not 0 <= l0 < l1 <= kv.shape[0]:
        raise ValueError(f"KV write layers [{l0}, {l1}) outside the pool's {kv.shape[0]}")
    if blocks and (min(blocks) < 0 or max(blocks) >= kv.shape[2]):
        raise ValueError(f"KV write block id outside the pool's {kv.shape[2]} blocks")


def _ext_for(kv: torch.Tensor):
    """The C++ ops for a contiguous host pool, else None (the torch path)."""
    return _ext() if kv.device.type == "cpu" and kv.is_contiguous() else None


def pack(kv: torch.Tensor, blocks: list[int], l0: int, l1: int,
         out: memoryview | None = None) -> tuple[memoryview, list[int]]:
    """kv: [L, 2, NB, BS, Hkv, D] -> (bytes of [l1-l0, 2, n, BS, Hkv, D], shape), gathered
    in one copy into one contiguous buffer (plus the copy to host for a device pool). out:
    a writable buffer of exactly piece_bytes() to gather into (a shared-memory region)."""
    import torch
    check_range(kv, blocks, l0, l1)
    shape = [l1 - l0, 2, len(blocks), *kv.shape[3:]]
    ext = _ext_for(kv)
    if ext is not None:         # row memcpys straight into the payload (kv_copy.cpp)
        if out is None:
            import numpy as np
            out = memoryview(np.empty(piece_bytes(kv, len(blocks), l0, l1), np.uint8))
        ext.kv_gather(kv, blocks, l0, l1, out)
        return out, shape
    ids = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    if out is None:
        return _flat(kv[l0:l1].index_select(2, ids).cpu()), shape
    dst = torch.frombuffer(out, dtype=torch.uint8).view(kv.dtype).view(*shape)
    if kv.is_cuda:
        dst.copy_(kv[l0:l1].index_select(2, ids))
    else:
        torch.index_select(kv[l0:l1], 2, ids, out=dst)
    return out, shape


def unpack_into(kv: torch.Tensor, blocks: list[int], l0: int, l1: int, payload: Buffer,
                dtype: str, shape: list[int]) -> None:
    """Scatter a write produced by pack() into this pool's blocks (in place)."""
    import torch
    check_range(kv, blocks, l0, l1)
    want = [l1 - l0, 2, len(blocks), *kv.shape[3:]]
    nbytes = piece_bytes(kv, len(blocks), l0, l1)
    mv = memoryview(payload)
    if not mv.c_contiguous:
        raise ValueError("KV payload is not one contiguous buffer")
    if (list(shape) != want or dtype not in DTYPE_NAMES or getattr(torch, dtype) != kv.dtype
            or mv.nbytes != nbytes):
        raise ValueError(f"KV payload {dtype}{list(shape)} ({mv.nbytes} B) does not fit "
                         f"pool {str(kv.dtype).removeprefix('torch.')}{want}")
    ext = _ext_for(kv)
    if ext is not None:         # row memcpys from the payload (kv_copy.cpp)
        ext.kv_scatter(kv, blocks, l0, l1, payload)
        return
    ids = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    kv[l0:l1].index_copy_(2, ids, _view(payload, kv.dtype, want).to(kv.device))


# ---- block layout: engine <-> kvstore ----------------------------------------------------

def snapshot_blocks(kv: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Copy of these blocks in block layout, [n, L, 2, BS, Hkv, D], contiguous, on the host:
    one gather (the caller holds the engine lock; the copy outlives it)."""
    import torch
    ids = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    return kv.permute(2, 0, 1, 3, 4, 5).index_select(0, ids).cpu()


def plan_puts(num_blocks: int, num_layers: int, lb: int, max_bytes: int) -> list[tuple[int, int]]:
    """Block ranges [b0, b1) of the puts that carry num_blocks whole blocks."""
    per = max(1, max_bytes // (num_layers * lb))
    return [(b0, min(num_blocks, b0 + per)) for b0 in range(0, num_blocks, per)]


def pack_put(snap: torch.Tensor, b0: int, b1: int) -> tuple[memoryview, list[list[int]]]:
    """Blocks b0..b1 of a snapshot_blocks() copy: (payload, checksums[block][layer])."""
    L = snap.shape[1]
    lb = snap[0, 0].numel() * snap.element_size()
    payload = _flat(snap[b0:b1])
    sums = [[checksum(payload[(i * L + l) * lb:(i * L + l + 1) * lb]) for l in range(L)]
            for i in range(b1 - b0)]
    return payload, sums


def unpack_put(data: Buffer, num_blocks: int, num_layers: int, lb: int,
               sums: list[list[int]]) -> list[tuple[int, tuple[bytes, ...], tuple[int, ...]]]:
    """A put's payload -> (index, layers, checksums) of every block whose layers all match
    their checksums (the others are left out). ValueError when the sizes do not add up."""
    L = num_layers
    if len(sums) != num_blocks or len(data) != num_blocks * L * lb:
        raise ValueError(f"{len(data)} bytes for {num_blocks} blocks x {L} layers x {lb} bytes")
    mv = memoryview(data).cast("B")
    good = []
    for i in range(num_blocks):
        layers = tuple(bytes(mv[(i * L + l) * lb:(i * L + l + 1) * lb]) for l in range(L))
        block_sums = tuple(sums[i])
        if len(block_sums) == L and all(checksum(x) == c for x, c in zip(layers, block_sums)):
            good.append((i, layers, block_sums))
    return good


def plan_pulls(num_blocks: int, num_layers: int, lb: int,
               max_bytes: int) -> list[tuple[int, int, int]]:
    """(layer, b0, b1) of the pulls that load num_blocks blocks, layer 0 first."""
    per = max(1, max_bytes // lb)
    return [(l, b0, min(num_blocks, b0 + per))
            for l in range(num_layers) for b0 in range(0, num_blocks, per)]


def pack_layer(layers: Sequence[bytes], sums: Sequence[int]) -> tuple[bytes, dict[str, str]]:
    """One layer of a run of stored blocks: (payload, headers carrying their checksums)."""
    return b"".join(layers), {LAYER_SUMS: json.dumps(list(sums))}


def unpack_layer(data: Buffer, headers: dict[str, str] | None, kv: torch.Tensor,
                 num_blocks: int) -> torch.Tensor:
    """A layer-pull reply -> [2, n, BS, Hkv, D] (a view of `data`, ready for
    write_loaded_layer). ChecksumError when the size or any block's checksum is wrong,
    ValueError when the checksums are missing."""
    lb = layer_bytes(kv)
    try:
        sums = json.loads((headers or {})[LAYER_SUMS])
    except (KeyError, ValueError) as e:
        raise ValueError(f"layer reply without checksums: {e!r}") from e
    mv = memoryview(data).cast("B")
    if len(mv) != num_blocks * lb or len(sums) != num_blocks or any(
            checksum(mv[j * lb:(j + 1) * lb]) != sums[j] for j in range(num_blocks)):
        raise ChecksumError("checksum mismatch")
    return _view(mv, kv.dtype, (num_blocks, 2, *kv.shape[3:])).transpose(0, 1)
