"""Cache-aware routing: which decode instance most likely holds a prompt's prefix.

Like SGLang's cache-aware router, the gateway learns from its own routing history: a
request sent to instance X leaves its prompt's prefix in X's prefix cache (L1), so the
next request sharing that prefix should go to X. Prompts are cut into pieces of
`granularity` tokens keyed by a chained hash; `best` finds, per instance, the longest
run of leading pieces it was last sent. The map is an LRU of bounded size, and it is only
a hint: a stale entry (the instance evicted the blocks or restarted) costs a miss.
Pure bookkeeping, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict

from shared.engine.prefix import block_keys, prefix_salt, salted

_SALT = prefix_salt("gateway-affinity")


class PrefixAffinity:
    def __init__(self, granularity: int = 64, max_entries: int = 200_000):
        self.granularity = granularity
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def _keys(self, prompt_ids: list[int], cache_salt: str = "") -> list[bytes]:
        return block_keys(prompt_ids, self.granularity, salted(_SALT, cache_salt))

    def best(self, prompt_ids: list[int], cache_salt: str = "") -> dict[str, int]:
        """instance -> prompt tokens of its longest known leading prefix, among requests
        with the same cache_salt (the tenant's: routing never hints at another's prompts)."""
        out: dict[str, int] = {}
        for i, k in enumerate(self._keys(prompt_ids, cache_salt)):
            owner = self._owner.get(k)
            if owner is None:
                break
            out[owner] = (i + 1) * self.granularity
        return out

    def record(self, prompt_ids: list[int], instance: str, cache_salt: str = "") -> None:
        for k in self._keys(prompt_ids, cache_salt):
            self._owner[k] = instance
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, instance: str) -> None:
        for k in [k for k, v in self._owner.items() if v == instance]:
            del self._owner[k]

    def __len__(self) -> int:
        return len(self._owner)
