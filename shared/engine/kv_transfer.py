"""Moved to shared/kv/wire.py (the one module for every KV wire). This alias stays only
until services/decode imports from shared.kv.wire; then delete it."""
from shared.kv.wire import Piece, pack, plan, unpack_into  # noqa: F401
