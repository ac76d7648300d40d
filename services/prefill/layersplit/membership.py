"""Who is in the group right now: rendezvous, generations, liveness.

Rank 0 hosts a torch.distributed TCPStore at the group's address; every rank (rank 0
too) is a client of it. A *generation* g is one process group over all N ranks, built on
the store under the prefix "g<g>/". The store's key "gen" names the generation to form:

  - a rank that starts (or restarts) bumps it (compare-and-set g -> g+1), so the others
    leave their current group and every rank forms the next one together;
  - to form g, a rank marks itself ready under "g<g>/ready/<rank>" and waits for all N
    marks; only then does it build the process group (so building never waits on a dead
    rank). A rank that waits too long bumps g (someone is dead: try again later) and
    serves alone meanwhile;
  - while in a group, each rank beats "hb/<rank>" every heartbeat_s and watches the
    others' beats; a silent rank, a transfer error or a store error ends the group: the
    rank bumps g and its cached entries are lost (every entry has layers on every rank).

Serving never waits for any of this: without a group a rank computes what it would have
loaded (no hits), which is always correct.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("pdmesh.layersplit")


class Membership:
    def __init__(self, cfg, on_join, on_lost):
        """on_join(gen, pg, store): a group formed; on_lost(reason): it ended."""
        self.cfg = cfg
        self.on_join, self.on_lost = on_join, on_lost
        self.gen = -1                 # the generation this rank is in (-1: none)
        self.broken: str | None = None
        self.stopping = threading.Event()
        self.counters = {"group_generations": 0, "group_losses": 0}
        self._master = None
        self.thread = threading.Thread(target=self.run, name="layersplit-members", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def fail(self, reason: str) -> None:
        """Called from any thread when a transfer with a peer failed."""
        if self.gen >= 0 and self.broken is None:
            self.broken = reason

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                store = self._connect()
                self._session(store)
            except Exception as e:  # noqa: BLE001 - store gone (rank 0 died): retry
                self._leave(f"store: {e!r}")
                self.stopping.wait(self.cfg.heartbeat_s * 2)

    def _connect(self):
        host, port = self.cfg.host_port
        t = timedelta(seconds=self.cfg.timeout_s)
        if self.cfg.rank == 0 and self._master is None:
            self._master = dist.TCPStore(host, port, None, True, timeout=t,
                                         wait_for_workers=False)
        return dist.TCPStore(host, port, None, False, timeout=t)

    def _session(self, store) -> None:
        g = int(store.add("gen", 0))
        store.compare_set("gen", str(g), str(g + 1))      # a new member: everyone re-forms
        while not self.stopping.is_set():
            g = int(store.add("gen", 0))
            if g == self.gen:
                if not self._healthy(store):
                    store.compare_set("gen", str(g), str(g + 1))
                    self._leave(self.broken or "peer silent")
                continue
            if self.gen >= 0:
                self._leave(f"generation {g} forming")
            self._form(store, g)

    def _healthy(self, store) -> bool:
        self.stopping.wait(self.cfg.heartbeat_s)
        if self.broken is not None:
            return False
        now = time.time()
        store.set(f"hb/{self.cfg.rank}", repr(now))
        for r in range(self.cfg.size):
            if r != self.cfg.rank and now - float(store.get(f"hb/{r}")) > 6 * self.cfg.heartbeat_s:
                self.broken = f"rank {r} silent"
                return False
        return True

    def _form(self, store, g: int) -> None:
        n, rank = self.cfg.size, self.cfg.rank
        store.set(f"g{g}/ready/{rank}", "1")
        deadline = time.monotonic() + self.cfg.timeout_s
        keys = [f"g{g}/ready/{r}" for r in range(n)]
        while not store.check(keys):
            if int(store.add("gen", 0)) != g:
                return
            if time.monotonic() > deadline or self.stopping.is_set():
                store.compare_set("gen", str(g), str(g + 1))   # someone is missing: retry later
                return
            time.sleep(0.05)
        store.set(f"hb/{rank}", repr(time.time()))
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g{g}/pg/", store), rank, n,
                                   timedelta(seconds=self.cfg.timeout_s))
        self.gen, self.broken = g, None
        self.counters["group_generations"] += 1
        log.info("layersplit rank %d/%d joined generation %d", rank, n, g)
        self.on_join(g, pg, store)

    def _leave(self, reason: str) -> None:
        if self.gen < 0:
            return
        log.warning("layersplit rank %d left generation %d: %s", self.cfg.rank, self.gen, reason)
        self.gen, self.broken = -1, None
        self.counters["group_losses"] += 1
        self.on_lost(reason)
