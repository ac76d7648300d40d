"""Which of a computed prompt's whole blocks go to kvstore (HiCache L2/L3): prefill's
after the KV went to decode, and decode's for a prompt it computed itself (colocated), so
a prefix computed on either path is a hit for the next request on either path.

write_through sends every whole block kvstore lacks;
write_through_selective sends a block only the second time its prefix is seen (one-off
prompts never cost host memory), like SGLang's selective policy; none sends nothing. The
copy is taken now, the send runs in the background: a token never waits for it."""
from __future__ import annotations

from collections import OrderedDict

SEEN_KEYS = 100_000     # prefix keys remembered for write_through_selective
WRITE_POLICIES = ("write_through", "write_through_selective", "none")


class WriteBack:
    def __init__(self, policy: str, kvc):
        self.policy = policy
        self.kvc = kvc
        self.seen: OrderedDict[bytes, None] = OrderedDict()

    def __call__(self, engine, blocks: list[int], keys: list[bytes]) -> None:
        """blocks[i] holds the KV whose prefix key is keys[i] (the caller still holds
        them: they are copied now)."""
        if self.policy == "none" or not keys:
            return
        if self.policy == "write_through_selective":
            n = self._seen_before(keys)
            keys, blocks = keys[:n], blocks[:n]
        self.kvc.write_back(engine, blocks, keys)

    def _seen_before(self, keys: list[bytes]) -> int:
        """How many leading keys were seen before; remembers them all (LRU-bounded)."""
        n = 0
        while n < len(keys) and keys[n] in self.seen:
            n += 1
        for k in keys:
            self.seen[k] = None
            self.seen.move_to_end(k)
        while len(self.seen) > SEEN_KEYS:
            self.seen.popitem(last=False)
        return n
