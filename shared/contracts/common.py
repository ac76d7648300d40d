"""Pieces every contract shares: the version field, typed errors, the codec helpers."""
from __future__ import annotations

import enum
from typing import TypeVar

import msgspec

VERSION = 1


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"              # undecodable or wrong-typed message
    INVALID_REQUEST = "invalid_request"      # decodable but not servable (too long, bad ids)
    TOKENIZER_MISMATCH = "tokenizer_mismatch"
    OVERLOADED = "overloaded"
    NOT_FOUND = "not_found"
    ABORTED = "aborted"
    PREFILL_FAILED = "prefill_failed"
    INSTANCE_LOST = "instance_lost"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    ANOMALY = "anomaly_detected"             # the speculative monitor aborted the request


class ErrorReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    code: ErrorCode
    message: str
    request_id: str | None = None


class Ok(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    v: int = VERSION
    request_id: str | None = None


T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class Codec:
    """One typed JSON decoder per endpoint: decode(bytes) -> T or raises ContractError."""

    def __init__(self, typ: type[T]):
        self.typ = typ
        self._dec = msgspec.json.Decoder(typ)

    def decode(self, data: bytes) -> T:
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ContractError(f"bad {self.typ.__name__}: {e}") from e


class ContractError(ValueError):
    """A message did not match its contract; answered with ErrorCode.BAD_MESSAGE."""
