"""The engine's prefix cache (tier L1) and its lower-tier loads.

Whole prompt blocks are indexed by a chained key of their tokens (prefix.py); a request
takes the longest cached prefix from the pool (L1) and computes only the rest. A prompt's
last, partial block is indexed too (its tail key): a request computing its own prompt
copies up to a block's worth of tokens more from such a block, or from a whole cached
block it cannot take whole, into a fresh block of its own (token-level reuse, as SGLang's
radix cache has; a repeated short chat prompt then computes one token, not up to 16). A longer
prefix held by a lower tier (kvstore) is loaded layer by layer into fresh blocks
(layer_load.py) while the rest computes; a failed load is recomputed. In deterministic
mode only whole chunks are shared: their KV is bit-identical however the prompt is split.

Everything it uses is passed in: the engine's settings, block pool, KV pool and
counters. Methods run on the engine's owner thread (engine.py), except
write_loaded_layer: the loader's side, fenced by the load itself (layer_load.py).
"""
from __future__ import annotations

import torch

from .block_pool import BlockPool, NoFreeBlocks
from .config import EngineConfig
from .layer_load import LayerLoad
from .prefix import block_keys, salted, tail_key
from .scheduler import Scheduled, cancel_load
from .sequence import Sequence


class PrefixCache:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, kv: torch.Tensor, num_layers: int,
                 salt: bytes, counters: dict):
        self.cfg = cfg
        self.pool = pool
        self.kv = kv
        self.num_layers = num_layers
        self.salt = salt
        self.counters = counters
        self.last_load: dict = {}       # timeline of the latest completed layer-wise load

    def keys(self, prompt_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """Keys of the prompt's blocks that may be shared (with L1 or a lower tier), within
        one tenant: cache_salt (DecodeSubmit.cache_salt) starts the chain."""
        bs, C, n = self.cfg.block_size, self.cfg.chunk_size, len(prompt_ids)
        if self.cfg.deterministic:   # only whole chunks: their KV does not depend on the split
            nb = 0 if C % bs else (n // C) * C // bs
        else:
            nb = n // bs
        return block_keys(prompt_ids, bs, salted(self.salt, cache_salt), nb)

    def cached_tokens(self, prompt_ids: list[int], cache_salt: str = "") -> int:
        """Prompt tokens an L1 hit on whole blocks would serve right now (a peek: nothing is
        taken; a computed prompt may be served up to a block's worth more, by a tail)."""
        if not self.cfg.prefix_cache:
            return 0
        hit = len(self.pool.match(self.keys(prompt_ids, cache_salt)))
        return self.usable(hit, len(prompt_ids)) * self.cfg.block_size

    def usable(self, nblocks: int, prompt_len: int) -> int:
        """A hit leaves at least one prompt token to compute (its logits are sampled) and,
        in deterministic mode, ends on a chunk boundary."""
        bs = self.cfg.block_size
        nblocks = min(nblocks, (prompt_len - 1) // bs)
        if self.cfg.deterministic:
            nblocks -= nblocks % (self.cfg.chunk_size // bs)
        return max(0, nblocks)

    def attach(self, seq: Sequence, tier_blocks: int = 0, tail: bool = False
               ) -> LayerLoad | None:
        """Give a new sequence its cached prefix: L1 blocks (referenced), plus fresh blocks
        for a lower tier's longer prefix, to be filled by the returned LayerLoad. tail (a
        sequence that computes its own prompt): marked to take, as the scheduler admits
        it, the tokens a cached partial block serves (attach_tail; never in
        deterministic mode, or with a load)."""
        seq.block_table, seq.num_registered, seq.num_evicted = [], 0, 0
        seq.tail_registered = seq.want_tail = False
        seq.num_computed = seq.num_l1 = seq.num_cached = seq.draft_computed = 0
        seq.keys = self.keys(seq.prompt_ids, seq.cache_salt)
        self.counters["prompt_tokens"] += len(seq.prompt_ids)
        tail = tail and self.cfg.prefix_cache and not self.cfg.deterministic
        if not seq.keys and not tail:
            return None
        l1 = self.pool.match(seq.keys) if self.cfg.prefix_cache else []
        total = self.usable(max(len(l1), tier_blocks), len(seq.prompt_ids))
        l1 = l1[:total]
        if total > len(l1):       # a load starts where L1 ends: keep that on a chunk boundary
            l1 = l1[:self.usable(len(l1), len(seq.prompt_ids))]
        self.pool.take(l1, queried=len(seq.keys))
        seq.block_table = list(l1)
        load = self._start_load(seq, len(l1), total) if total > len(l1) else None
        if load is None:
            total = len(l1)
        seq.num_registered = len(l1)
        seq.num_l1 = len(l1) * self.cfg.block_size
        seq.num_computed = seq.num_cached = total * self.cfg.block_size
        seq.want_tail = tail and load is None   # the scheduler's, as it admits (attach_tail)
        self.counters["prefix_hit_tokens"] += seq.num_cached
        return load

    def attach_tail(self, seq: Sequence) -> None:
        """Copy the leading tokens of a cached block that continue the sequence's cached
        prefix into a fresh block of its own (the source may be anyone's; the copy is).
        The scheduler's, as the sequence is admitted: a waiting sequence holds no block
        of its own."""
        src = self._tail_source(seq, len(seq.block_table))
        if src is None:
            return
        block, n = src
        try:
            fresh = self.pool.allocate(1)[0]   # may evict the source itself: then a no-op
        except NoFreeBlocks:
            return
        self.kv[:, :, fresh, :n] = self.kv[:, :, block, :n]
        seq.block_table.append(fresh)
        seq.num_computed += n
        seq.num_cached += n
        self.counters["tail_hit_tokens"] += n
        self.counters["prefix_hit_tokens"] += n

    def _tail_source(self, seq: Sequence, u: int) -> tuple[int, int] | None:
        """(block, tokens) of the cached block holding the most prompt tokens after the
        sequence's u whole cached blocks, those tokens leaving the last prompt token to
        compute: the next whole block itself (cached, but taking it whole would leave
        nothing to compute), else the longest tail key that matches."""
        bs, prompt = self.cfg.block_size, seq.prompt_ids
        room = min(bs - 1, len(prompt) - 1 - u * bs)
        if room < 1:
            return None
        if u < len(seq.keys) and (whole := self.pool.match(seq.keys[u:u + 1])):
            return whole[0], room
        parent = self._parent(seq, u)
        rest = prompt[u * bs:u * bs + bs - 1]
        for n in range(len(rest), 0, -1):
            if found := self.pool.match([tail_key(parent, rest[:n])]):
                return found[0], min(n, room)
        return None

    def _start_load(self, seq: Sequence, first: int, total: int) -> LayerLoad | None:
        try:
            fresh = self.pool.allocate(total - first)
        except NoFreeBlocks:
            return None
        seq.block_table += fresh
        seq.load = LayerLoad(seq.request_id, self.num_layers, fresh, seq.keys[first:total], first)
        self.counters["loads"] += 1
        return seq.load

    def register(self, seq: Sequence) -> None:
        """Index the sequence's whole prompt blocks whose KV is now complete."""
        limit = len(seq.keys)
        if seq.load is not None:
            if seq.load.complete:
                self.counters["loaded_blocks"] += len(seq.load.blocks)
                self.last_load = seq.load.timeline()
                seq.load = None
            else:
                limit = seq.load.first_block    # loaded blocks count once all layers landed
        if not self.cfg.prefix_cache:
            return
        upto = min(limit, seq.num_computed // self.cfg.block_size)
        while seq.num_registered < upto:
            i = seq.num_registered
            self.pool.register(seq.block_table[i], seq.keys[i])
            seq.num_registered += 1
        if seq.num_registered == len(seq.keys) == limit:
            self._register_tail(seq)

    def _register_tail(self, seq: Sequence) -> None:
        """Index the prompt's last, partial block under its tail key, once, as the prompt's
        KV completes (its leading slots never change while the block is allocated)."""
        bs, n, u = self.cfg.block_size, len(seq.prompt_ids), len(seq.keys)
        if (self.cfg.deterministic or seq.num_computed < n or seq.tail_registered
                or n == u * bs or u < seq.num_evicted or u >= len(seq.block_table)):
            return
        seq.tail_registered = True
        self.pool.register(seq.block_table[u], tail_key(self._parent(seq, u),
                                                        seq.prompt_ids[u * bs:]))

    def _parent(self, seq: Sequence, u: int) -> bytes:
        """What a tail after u whole blocks chains from: block u-1's key, or the tenant's
        salt for the first block."""
        return seq.keys[u - 1] if u else salted(self.salt, seq.cache_salt)

    def write_loaded_layer(self, load: LayerLoad, layer: int, data: torch.Tensor,
                           b0: int = 0) -> bool:
        """Copy data [2, n, block_size, Hkv, D] into layer `layer` of the load's blocks
        b0..b0+n (the loader's side, any thread). False once the request went away:
        nothing written."""
        ids = torch.tensor(load.blocks[b0:b0 + data.shape[1]], dtype=torch.long)

        def copy():
            self.kv[layer, :, ids] = data.to(self.kv.device)
        return load.land(copy)

    def recompute_failed_loads(self, batch: list[Scheduled]) -> None:
        """A load failed mid-forward: nothing of this step counts. Sequences whose load
        failed compute those blocks themselves (same blocks, from where L1 ended)."""
        for s in batch:
            ld = s.seq.load
            if ld is not None and ld.error is not None:
                cancel_load(s.seq)
                self.counters["load_failures"] += 1
                self.counters["prefix_hit_tokens"] -= s.seq.num_cached - s.seq.num_l1
                s.seq.num_computed = s.seq.num_cached = s.seq.num_l1
