"""KV block writes: raw tensor bytes as the NATS payload, metadata in NATS headers.

Payload: kv[layer_start:layer_end, :, blocks] of the sender's pool, C-contiguous,
shape [layers, 2, len(block_ids), block_size, Hkv, D], in `dtype`.
"""
from __future__ import annotations

import json

import msgspec

from .common import VERSION, ContractError
from .messages import PrefillDone


class KvWrite(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    epochs: list[int]
    block_ids: list[int]
    layer_start: int
    layer_end: int
    dtype: str
    shape: list[int]
    checksum: int          # of the payload: shared.kv.wire.write_checksum
    seq: int               # index of this write within the job
    sender: str
    attempt: str = ""      # the prefill attempt (PrefillClaim.attempt) that issued it
    # the attempt's PrefillDone (status OK, writes_issued 1) when this is its only write:
    # decode starts the request on it once the write has landed (no separate message)
    done: PrefillDone | None = None

    def headers(self) -> dict[str, str]:
        h = msgspec.structs.asdict(self)
        done = h.pop("done")
        out = {f"Pdmesh-{k}": json.dumps(v) if isinstance(v, list) else str(v)
               for k, v in h.items()} | {"Pdmesh-v": str(VERSION)}
        if done is not None:
            out["Pdmesh-done"] = msgspec.json.encode(done).decode()
        return out

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> "KvWrite":
        if not headers:
            raise ContractError("KV write without headers")
        try:
            raw = {k[len("Pdmesh-"):]: v for k, v in headers.items() if k.startswith("Pdmesh-")}
            raw.pop("v", None)
            for k in ("epochs", "block_ids", "shape"):
                raw[k] = json.loads(raw[k])
            if "done" in raw:
                raw["done"] = msgspec.json.decode(raw["done"], type=PrefillDone)
            return msgspec.convert(raw, cls, strict=False)
        except (KeyError, ValueError, TypeError, msgspec.ValidationError,
                msgspec.DecodeError) as e:
            raise ContractError(f"bad KV write headers: {e}") from e


class KvWriteAck(msgspec.Struct, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    seq: int
    applied: bool          # False: fenced (stale epoch) or unknown request; discarded

