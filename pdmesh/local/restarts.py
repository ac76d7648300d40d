"""When a crashed child of `pdmesh up` is started again, and when the supervisor gives up.

A pure core (no I/O, the clock passed in): the supervisor asks `on_exit(name, now)` each time
a child exits without being asked to, and gets back how long to wait before starting it
again, or why it should not (a crash loop: `limit` exits within `window_s`). Backoff doubles
with each exit still inside the window: base_s, 2 base_s, 4 base_s ... at most max_s.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Restart:
    delay_s: float        # wait this long, then start it again
    attempt: int          # exits of this child inside the window, this one included


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


@dataclass(slots=True)
class RestartPolicy:
    limit: int = 5             # this many exits of one child within window_s: a crash loop
    window_s: float = 60.0
    base_s: float = 0.5
    max_s: float = 8.0
    _exits: dict[str, deque[float]] = field(default_factory=dict)

    def __post_init__(self):
        if self.limit < 1 or self.window_s <= 0 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError("restart policy: need limit >= 1, window_s > 0, "
                             "0 <= base_s <= max_s")

    def on_exit(self, name: str, now: float) -> Restart | GiveUp:
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while exits and exits[0] <= now - self.window_s:
            exits.popleft()
        n = len(exits)
        if n >= self.limit:
            return GiveUp(f"{name} exited {n} times within {self.window_s:g} s (crash loop; "
                          f"limit {self.limit}, --restart-limit/--restart-window)")
        return Restart(min(self.base_s * 2 ** (n - 1), self.max_s), n)

    def exits(self, name: str) -> int:
        return len(self._exits.get(name, ()))
