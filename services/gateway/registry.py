"""Decode instances as the gateway sees them through heartbeats: liveness and load.

Pure bookkeeping (the caller passes the clock). An instance is alive while its last
heartbeat arrived within `dead_after_s`, measured on this process's monotonic clock, so
clock skew between hosts does not matter. `choose` picks the least loaded live instance:
running + waiting + queue depth from its last heartbeat, plus the requests this gateway
sent it since that have not ended yet (a burst between two heartbeats spreads instead of
piling onto one; short requests one after another do not add up to a load nobody
carries), ties broken by more free KV blocks, then by id.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from shared import subjects
from shared.contracts.messages import Heartbeat

log = logging.getLogger("pdmesh.gateway")

FORGET_AFTER_S = 300.0   # drop instances silent this long from the books
MAX_ID_CHARS = 128
MAX_COUNT = 1 << 31      # a heartbeat's counts above this (or below 0) are not believed
_COUNTS = ("running", "waiting", "queue_depth", "blocks_free", "blocks_used",
           "blocks_quarantined", "capacity", "max_model_len")


def heartbeat_problem(hb: Heartbeat) -> str | None:
    """Why a decode heartbeat cannot be believed, or None. Its instance id must make a
    valid subject token (shared/subjects.py's rule: it names the instance's subjects)."""
    iid = hb.instance_id
    if not iid or len(iid) > MAX_ID_CHARS:
        return f"instance id of {len(iid)} characters"
    try:
        subjects.decode_submit(iid)
    except ValueError:
        return "instance id is not a subject token (lowercase letters, digits and _ only)"
    bad = [n for n in _COUNTS if not 0 <= getattr(hb, n) < MAX_COUNT]
    return f"counts out of range: {', '.join(bad)}" if bad else None


@dataclass(slots=True)
class Instance:
    hb: Heartbeat
    seen: float              # monotonic time the last heartbeat arrived
    sent_since_hb: int = 0   # requests this gateway submitted after it, not yet ended
    beat: int = 0            # which heartbeat this is (Registry's count)

    @property
    def load(self) -> int:
        return self.hb.running + self.hb.waiting + self.hb.queue_depth + self.sent_since_hb


class Registry:
    def __init__(self, dead_after_s: float, fingerprint: str = ""):
        self.dead_after_s = dead_after_s
        self.fingerprint = fingerprint     # ours; instances with another one are not chosen
        self.instances: dict[str, Instance] = {}
        self.invalid = 0                   # heartbeats ignored (heartbeat_problem)
        self._logged: set[str] = set()     # bad ids already logged (bounded)
        self._beats = 0                    # heartbeats taken in, for sent()/ended()

    # ---- books -----------------------------------------------------------------------
    def observe(self, hb: Heartbeat, now: float) -> None:
        if hb.service != "decode":
            return
        problem = heartbeat_problem(hb)
        if problem is not None:
            self.invalid += 1
            if hb.instance_id not in self._logged and len(self._logged) < 1000:
                self._logged.add(hb.instance_id)
                log.warning("ignoring decode heartbeats from %r: %s", hb.instance_id[:80], problem)
            return
        self._beats += 1
        self.instances[hb.instance_id] = Instance(hb, now, beat=self._beats)
        for iid in [i for i, inst in self.instances.items() if now - inst.seen > FORGET_AFTER_S]:
            del self.instances[iid]

    def sent(self, instance_id: str, n: int = 1) -> int | None:
        """n requests went to the instance (n = -1: one it refused after all). Returns the
        heartbeat they count on top of, for ended()."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return None
        inst.sent_since_hb = max(0, inst.sent_since_hb + n)
        return inst.beat

    def ended(self, instance_id: str, beat: int | None) -> None:
        """A request sent() on top of heartbeat `beat` has ended. While no heartbeat came
        since, it still counted in the instance's load: not any more (a later heartbeat
        counts whatever is still running itself)."""
        inst = self.instances.get(instance_id)
        if inst is not None and beat is not None and inst.beat == beat:
            inst.sent_since_hb = max(0, inst.sent_since_hb - 1)

    # ---- questions -------------------------------------------------------------------
    def is_alive(self, instance_id: str, now: float) -> bool:
        inst = self.instances.get(instance_id)
        return inst is not None and now - inst.seen <= self.dead_after_s

    def incarnation(self, instance_id: str) -> str:
        """The process now heartbeating as instance_id ('' unknown)."""
        inst = self.instances.get(instance_id)
        return inst.hb.incarnation if inst is not None else ""

    def silent_for(self, instance_id: str, now: float) -> float | None:
        inst = self.instances.get(instance_id)
        return None if inst is None else now - inst.seen

    def alive(self, now: float) -> list[Instance]:
        return [i for i in self.instances.values() if now - i.seen <= self.dead_after_s]

    def compatible(self, inst: Instance) -> bool:
        theirs = inst.hb.tokenizer_fingerprint
        return not (self.fingerprint and theirs and theirs != self.fingerprint)

    def choose(self, now: float, exclude: set[str] | frozenset[str] = frozenset(),
               cached: dict[str, int] | None = None, min_cached: int = 256,
               max_extra_load: int = 4, prefer: str | None = None) -> str | None:
        """`prefer` if it is a candidate (n > 1: choice 0's instance, which holds the
        prompt), else the least loaded live, compatible instance not in `exclude`, or None.
        cached: instance -> prompt tokens it likely holds in its prefix cache; the
        instance with the most (at least min_cached) wins unless it carries more than
        max_extra_load requests above the least loaded one (then balance wins)."""
        cands = [i for i in self.alive(now)
                 if i.hb.instance_id not in exclude and self.compatible(i) and i.hb.accepting]
        if not cands:
            return None
        if prefer is not None and any(i.hb.instance_id == prefer for i in cands):
            return prefer
        best = min(cands, key=lambda i: (i.load, -i.hb.blocks_free, i.hb.instance_id))
        if cached:
            warm = [i for i in cands if cached.get(i.hb.instance_id, 0) >= min_cached
                    and i.load <= best.load + max_extra_load]
            if warm:
                return max(warm, key=lambda i: (cached[i.hb.instance_id], -i.load)).hb.instance_id
        return best.hb.instance_id

    def capacity(self, now: float) -> int:
        """Requests the live decode instances batch at once, together."""
        return sum(i.hb.capacity or 16 for i in self.alive(now) if i.hb.accepting)

    def why_none(self, now: float, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """Why choose() returned None, in words for a 503."""
        alive = self.alive(now)
        if not alive:
            return "no decode instance is alive (none has sent a heartbeat recently)"
        if not any(self.compatible(i) for i in alive):
            return (f"the {len(alive)} live decode instance(s) use a different tokenizer "
                    f"than this gateway's model")
        return f"all {len(exclude)} decode instance(s) tried refused or did not answer"

    def totals(self, now: float) -> dict[str, int]:
        """Sums over live instances, for /metrics and /health."""
        alive = self.alive(now)
        return {"instances": len(alive),
                "running": sum(i.hb.running for i in alive),
                "waiting": sum(i.hb.waiting for i in alive),
                "queue_depth": sum(i.hb.queue_depth for i in alive),
                "blocks_free": sum(i.hb.blocks_free for i in alive),
                "blocks_used": sum(i.hb.blocks_used for i in alive),
                "blocks_quarantined": sum(i.hb.blocks_quarantined for i in alive)}
