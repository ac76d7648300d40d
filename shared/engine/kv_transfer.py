"""Packing KV blocks into transfer messages and back, independent of the transport.

A message holds kv[l0:l1, :, blocks] of the sender's pool as raw bytes:
shape [l1 - l0, 2, len(blocks), block_size, Hkv, D]. Messages are sized to fit the
transport's max payload: whole blocks (all layers) when they fit, else layer slices of
one block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_cache import gather_blocks, scatter_blocks

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class Piece:
    index: int            # positions in the request's block list: [b0, b1)
    b0: int
    b1: int
    l0: int               # layers [l0, l1)
    l1: int


def plan(num_blocks: int, kv: torch.Tensor, max_bytes: int) -> list[Piece]:
    """Split a request's blocks x layers into messages of at most max_bytes."""
    L = kv.shape[0]
    layer_block = kv[0, :, 0].numel() * kv.element_size()     # one layer of one block (K+V)
    if layer_block > max_bytes:
        raise ValueError(f"one layer of one KV block is {layer_block} bytes > max payload {max_bytes}")
    pieces: list[Piece] = []
    if L * layer_block <= max_bytes:
        per = max_bytes // (L * layer_block)
        for b0 in range(0, num_blocks, per):
            pieces.append(Piece(len(pieces), b0, min(num_blocks, b0 + per), 0, L))
    else:
        per = max_bytes // layer_block
        for b in range(num_blocks):
            for l0 in range(0, L, per):
                pieces.append(Piece(len(pieces), b, b + 1, l0, min(L, l0 + per)))
    return pieces


def pack(kv: torch.Tensor, blocks: list[int], l0: int, l1: int) -> tuple[bytes, list[int]]:
    """kv: [L, 2, NB, BS, Hkv, D] -> (bytes of [l1-l0, 2, n, BS, Hkv, D], shape)."""
    ids = torch.tensor(blocks, dtype=torch.long)
    parts = [gather_blocks(kv[l, c], ids) for l in range(l0, l1) for c in (0, 1)]
    t = torch.stack(parts).view(l1 - l0, 2, len(blocks), *kv.shape[3:])
    return t.contiguous().view(torch.uint8).numpy().tobytes(), list(t.shape)


def unpack_into(kv: torch.Tensor, blocks: list[int], l0: int, l1: int, payload: bytes | memoryview,
                dtype: str, shape: list[int]) -> None:
    """Scatter a message produced by pack() into this pool's blocks (in place)."""
    want = [l1 - l0, 2, len(blocks), *kv.shape[3:]]
    if list(shape) != want or DTYPES.get(dtype) != kv.dtype:
        raise ValueError(f"KV payload {dtype}{list(shape)} does not fit pool "
                         f"{DTYPE_NAMES.get(kv.dtype)}{want}")
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv.dtype).view(*want)
    ids = torch.tensor(blocks, dtype=torch.long)
    for i, l in enumerate(range(l0, l1)):
        for c in (0, 1):
            scatter_blocks(kv[l, c], ids, t[i, c])
