"""KV block writes: raw tensor bytes as the NATS payload, the metadata (KvWrite, as JSON)
in the Pdmesh-write NATS header.

Payload: kv[layer_start:layer_end, :, blocks] of the sender's pool, C-contiguous,
shape [layers, 2, len(block_ids), block_size, Hkv, D], in `dtype`.
"""
from __future__ import annotations

import msgspec

from .common import VERSION, ContractError
from .messages import PrefillDone


class KvWrite(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    epochs: list[int]
    block_ids: list[int]
    layer_start: int
    layer_end: int
    dtype: str
    shape: list[int]
    seq: int               # index of this write within the job
    sender: str
    attempt: str = ""      # the prefill attempt (PrefillClaim.attempt) that issued it
    # the attempt's PrefillDone (status OK, writes_issued 1) when this is its only write:
    # decode starts the request on it once the write has landed (no separate message)
    done: PrefillDone | None = None
    # shared.kv.wire.write_digest: BLAKE3 (128 bits, hex) over every field above and the
    # payload; decode checks it after the write was admitted and its size matched
    digest: str = ""

    def headers(self) -> dict[str, str]:
        """The NATS headers of the write: Pdmesh-v and the whole struct as one JSON value
        (one header line to build and parse per write, readable in `nats sub`)."""
        return {"Pdmesh-v": str(VERSION), WRITE_HEADER: _ENC.encode(self).decode()}

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> "KvWrite":
        if not headers:
            raise ContractError("KV write without headers")
        if WRITE_HEADER not in headers and "Pdmesh-request_id" in headers:
            raise ContractError("KV write in the per-field headers of an older pdmesh (a "
                                "prefill from before the Pdmesh-write header): upgrade it")
        try:
            return _DEC.decode(headers[WRITE_HEADER])
        except (KeyError, msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ContractError(f"bad KV write headers: {e!r}") from e


WRITE_HEADER = "Pdmesh-write"       # a KV write's metadata: KvWrite as JSON
_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(KvWrite)


class KvWriteAck(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str
    seq: int
    applied: bool          # False: not admitted (no such request, not this attempt's
    #                        grant, a block outside it, a stale epoch); discarded

