"""kvstore verbs: prefix lookup, layer-wise fetch, write-back (HiCache L2/L3).

Keys are prefix keys (shared/engine/prefix.py) in hex. Block bytes travel raw: one
"layer block" is kv[layer, :, block] of an engine pool, shape [2, block_size, Hkv, D].
Every layer block carries its crc32; kvstore checks it before indexing a write, the disk
tier checks it on every read, and the loader checks it again before a layer is marked
ready.
"""
from __future__ import annotations

import json

import msgspec

from .common import VERSION, ContractError


class KvLookup(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    keys: list[str]


class KvLookupReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    hits: int                 # leading keys held in L2 or L3


class KvFetch(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Open a load: kvstore reads (and verifies) the blocks, then serves them layer by layer."""
    v: int = VERSION
    keys: list[str]


class KvFetchReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    load_id: str
    instance_id: str          # pull the layers from this kvstore instance
    blocks: int               # leading keys available (a bad or evicted block ends it)
    layer_bytes: int = 0      # bytes of one layer of one block
    num_layers: int = 0


class KvLayerPull(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """-> raw payload: layer `layer` of blocks [b0, b1) of the load, concatenated;
    header Pdmesh-checksums: their crc32s (JSON list)."""
    v: int = VERSION
    load_id: str
    layer: int
    b0: int
    b1: int
    last: bool = False        # the loader's final pull: the load can be closed


class KvPut(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Write-back, metadata in headers. Payload: for each block, its layers in order,
    each layer_bytes long. checksums[i][l]: crc32 of block i's layer l."""
    keys: list[str]
    num_layers: int
    layer_bytes: int
    checksums: list[list[int]]

    def headers(self) -> dict[str, str]:
        return {"Pdmesh-v": str(VERSION), "Pdmesh-keys": json.dumps(self.keys),
                "Pdmesh-num_layers": str(self.num_layers),
                "Pdmesh-layer_bytes": str(self.layer_bytes),
                "Pdmesh-checksums": json.dumps(self.checksums)}

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> "KvPut":
        if not headers:
            raise ContractError("KV put without headers")
        try:
            return cls(keys=json.loads(headers["Pdmesh-keys"]),
                       num_layers=int(headers["Pdmesh-num_layers"]),
                       layer_bytes=int(headers["Pdmesh-layer_bytes"]),
                       checksums=json.loads(headers["Pdmesh-checksums"]))
        except (KeyError, ValueError, TypeError) as e:
            raise ContractError(f"bad KV put headers: {e!r}") from e


class KvPutAck(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    stored: int
    rejected: int             # checksum mismatch or malformed: not indexed
