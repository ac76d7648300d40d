"""Prefix keys for KV blocks: a chained hash over whole blocks of token ids.

Block i's key hashes the key of block i-1 and the token ids of block i, so a key names
the whole prefix up to and including its block (like vLLM's and SGLang's prefix caches).
A block's leading tokens (fewer than a block: a prompt's last, partial block) have a
key of their own (`tail_key`), chained from the same prefix in a domain of its own.
The chain starts from a salt that names the model, its tokenizer, the KV dtype and the
block size: two models (or two precisions) never share an entry. A request's cache salt
(its tenant, DecodeSubmit.cache_salt) is mixed into that start (`salted`), so two
tenants' keys for the same tokens differ in every block: no tier can match across them.
"""
from __future__ import annotations

import hashlib
from array import array

KEY_BYTES = 16


def prefix_salt(*parts: str) -> bytes:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=KEY_BYTES).digest()


def salted(salt: bytes, cache_salt: str) -> bytes:
    """The chain's start for one tenant: `salt` itself when cache_salt is empty."""
    if not cache_salt:
        return salt
    return hashlib.blake2b(salt + b"\x1ftenant\x1f" + cache_salt.encode(),
                           digest_size=KEY_BYTES).digest()


def block_keys(token_ids: list[int], block_size: int, salt: bytes,
               num_blocks: int | None = None) -> list[bytes]:
    """Keys of the first `num_blocks` whole blocks (default: every whole block)."""
    n = len(token_ids) // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    keys, prev = [], salt
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


def tail_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of the first len(token_ids) < block_size tokens of the block after the
    prefix `parent` names (a key, or the salt for the first block). Hashed in a domain of
    its own: never equal to a whole block's key."""
    h = hashlib.blake2b(parent + b"\x1ftail", digest_size=KEY_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()
