"""The group's wire: point-to-point messages over one torch.distributed process group
(gloo on CPU), served by one thread per rank.

Ranks serve different requests at different times, so they cannot meet in collectives;
every exchange is point to point with tags instead. A message is a fixed header on the
control tag (op, sender, a fresh tag, count, layer) that the receiver's server thread takes
from any source; the body follows on the fresh tag(s), so bodies from different senders
never mix.

    FETCH  requester -> owner: slots + keys of one layer; the owner answers a status and
           the layer's KV [2, n, BS, Hkv, D] (zeros with status 0 when a slot no longer
           holds its key). The requester posts its receives before asking.
    INSERT origin -> every other rank: slots + keys + that rank's layers of the blocks.

Every wait on a peer has a timeout; a peer that died shows up as an error at once (its
sockets close) and the caller treats it as a lost group (membership.py).
"""
from __future__ import annotations

import itertools
import logging
import threading
from datetime import timedelta

import torch

from shared.engine.prefix import KEY_BYTES

log = logging.getLogger("pdmesh.layersplit")
CTRL = 1
FETCH, INSERT = 1, 2
HDR = 6
FOREVER = timedelta(days=365)


def keys_tensor(keys: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(len(keys), KEY_BYTES)


def tensor_keys(t: torch.Tensor) -> list[bytes]:
    return [bytes(row.tolist()) for row in t]


class Wire:
    def __init__(self, pg, rank: int, store, block_shape, dtype, timeout_s: float):
        self.pg, self.rank, self.store = pg, rank, store
        self.block_shape, self.dtype = block_shape, dtype
        self.timeout = timedelta(seconds=timeout_s)
        self._tags = itertools.count(16, 4)
        self._tag_lock = threading.Lock()
        self.closed = False
        self.counters = {"group_sent_bytes": 0, "group_recv_bytes": 0, "group_fetches": 0,
                         "group_fetches_served": 0, "group_inserts_sent": 0}

    def tag(self) -> int:
        with self._tag_lock:
            return next(self._tags) % (1 << 30) + 16

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.pg.send([t.contiguous()], dst, tag).wait(self.timeout)
        self.counters["group_sent_bytes"] += t.numel() * t.element_size()

    def _header(self, op: int, dst: int, tag: int, n: int, layer: int = 0) -> None:
        self._send(torch.tensor([op, self.rank, tag, n, layer, 0], dtype=torch.int64), dst, CTRL)

    # ---- requester side ----------------------------------------------------------------
    def fetch(self, dst: int, layer: int, slots: list[int], keys: list[bytes]):
        """Ask `dst` for one layer; returns a handle for `finish`."""
        n = len(slots)
        tag = self.tag()
        status = torch.zeros(1, dtype=torch.int64)
        data = torch.empty(2, n, *self.block_shape, dtype=self.dtype)
        works = [self.pg.recv([status], dst, tag + 2), self.pg.recv([data], dst, tag + 3)]
        self._header(FETCH, dst, tag, n, layer)
        self._send(torch.tensor(slots, dtype=torch.int64), dst, tag)
        self._send(keys_tensor(keys), dst, tag + 1)
        self.counters["group_fetches"] += 1
        return works, status, data

    def finish(self, handle) -> torch.Tensor | None:
        works, status, data = handle
        for w in works:
            w.wait(self.timeout)
        self.counters["group_recv_bytes"] += data.numel() * data.element_size()
        return data if int(status[0]) == 1 else None

    def insert(self, dst: int, slots: list[int], keys: list[bytes], data: torch.Tensor | None):
        tag = self.tag()
        self._header(INSERT, dst, tag, len(slots))
        self._send(torch.tensor(slots, dtype=torch.int64), dst, tag)
        self._send(keys_tensor(keys), dst, tag + 1)
        if data is not None:
            self._send(data, dst, tag + 2)
        self.counters["group_inserts_sent"] += 1

    # ---- server side ---------------------------------------------------------------------
    def serve(self, shard, on_error) -> None:
        """The server thread: answer FETCH, apply INSERT, until the wire is closed."""
        while not self.closed:
            hdr = torch.zeros(HDR, dtype=torch.int64)
            try:
                self.pg.recv_anysource([hdr], CTRL).wait(FOREVER)
                op, src, tag, n, layer, _ = hdr.tolist()
                slots = self._recv(torch.empty(n, dtype=torch.int64), src, tag).tolist()
                keys = tensor_keys(self._recv(torch.empty(n, KEY_BYTES, dtype=torch.uint8),
                                              src, tag + 1))
                if op == FETCH:
                    self._answer(shard, src, tag, layer, slots, keys)
                elif op == INSERT:
                    data = None
                    if shard.owned:
                        data = self._recv(torch.empty(len(shard.owned), 2, n, *self.block_shape,
                                                      dtype=self.dtype), src, tag + 2)
                    shard.put(slots, keys, data)
            except Exception as e:  # noqa: BLE001 - a peer died or the group re-forms
                if not self.closed:
                    on_error(f"serve: {e!r}")
                return

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.pg.recv([t], src, tag).wait(self.timeout)
        self.counters["group_recv_bytes"] += t.numel() * t.element_size()
        return t

    def _answer(self, shard, src: int, tag: int, layer: int, slots, keys) -> None:
        data = shard.gather(layer, slots, keys)
        ok = data is not None
        if not ok:
            data = torch.zeros(2, len(slots), *self.block_shape, dtype=self.dtype)
        self._send(torch.tensor([1 if ok else 0], dtype=torch.int64), src, tag + 2)
        self._send(data, src, tag + 3)
        self.counters["group_fetches_served"] += 1
