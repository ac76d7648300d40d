"""Whether to ask a peer that stopped answering (a circuit breaker, clock passed in).

kvstore frozen or cut off: each lookup waits its whole timeout (2 s) for nothing, and a
request's time to first token grows by that much while it lasts. After a timeout the
peer is taken for silent: one ask every probe_s (5 s) still goes out (is it back?) and
the rest are skipped at once (a miss: the engine computes). The first answer ends it, and
so does the peer's heartbeat (a restarted or thawed kvstore says so within a second, and
its write-backs, skipped while it was silent, go to it again at once).
"""
from __future__ import annotations


class Silence:
    def __init__(self, probe_s: float = 5.0):
        self.probe_s = probe_s
        self.since: float | None = None      # the first timeout of this silence
        self._probe_at = 0.0                 # the last ask let through while silent

    @property
    def silent(self) -> bool:
        return self.since is not None

    def may_ask(self, now: float) -> bool:
        if self.since is None:
            return True
        if now - self._probe_at >= self.probe_s:
            self._probe_at = now
            return True
        return False

    def timed_out(self, now: float) -> None:
        if self.since is None:
            self.since = now
        self._probe_at = now

    def answered(self) -> None:
        self.since = None
