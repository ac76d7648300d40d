"""Which KV path pays for a job, from what this prefill has measured (kv_stream="auto").

Whole-prompt KV leaves after the compute: the wire time adds to the first token. Layer-wise
streaming (stream.py) sends each layer of each chunk while the later layers compute: the
wire time hides behind the compute, but every layer wakes the event loop during the
forward (the GIL), a cost proportional to the compute. So streaming pays when the wire
time of a job's KV is more than a share of its compute time:

    stream  iff  kv_bytes / link_bytes_per_s  >=  min_share x prompt_tokens x compute_s_per_token

Both rates are measured here. A link's rate (per decode instance) comes from the jobs
that sent their whole KV after the compute, prompts over one chunk: the KV bytes acked
over the time at least one of their writes was in flight (the union of the writes'
intervals, so a window of concurrent writes counts once). A byte-weighted mean whose past
halves every HALF_BYTES. Streamed writes are not measured: each layer's write goes alone
as it is computed, so its time is the round trip, not what the link can carry. So a link
that gets streaming is measured again by every REPROBE-th job, sent whole: a link that
got faster (or was measured on a bad day) is found. A link not measured yet gets the whole
path: its first long job measures it.

Measured on two "hosts" sharing one 2-core CPU (docs/bench/kv_link.*, SmolLM2): at
1 Gbit/s the whole KV's wire time is 7% of the compute and streaming hides it; at 10 Gbit/s
it is 2% and whole-prompt is as fast or faster.

No I/O, no clock: callers pass `now` (time.monotonic()).
"""
from __future__ import annotations

from dataclasses import dataclass, field

HALF_BYTES = 16 << 20       # a link's past counts half once this many bytes more went
HALF_TOKENS = 8192          # the compute's past counts half after this many tokens more
REPROBE = 8                 # a streamed link's every 8th long job goes whole, measured


class Decaying:
    """sum(value) / sum(weight) over samples, the past halving every `half` of weight."""

    def __init__(self, half: float):
        self.half, self.value, self.weight = half, 0.0, 0.0

    def add(self, value: float, weight: float) -> None:
        d = 0.5 ** (weight / self.half)
        self.value, self.weight = self.value * d + value, self.weight * d + weight

    def ratio(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


@dataclass
class Link:
    """One decode instance's link, as this prefill's writes to it have seen it."""
    busy: Decaying = field(default_factory=lambda: Decaying(HALF_BYTES))  # seconds / byte
    in_flight: int = 0
    busy_since: float = 0.0        # the current busy interval's start (in_flight > 0)
    acc_bytes: int = 0             # bytes acked in the current busy interval
    streamed: int = 0              # jobs streamed since the last measurement

    @property
    def bytes_per_s(self) -> float | None:
        s_per_byte = self.busy.ratio()
        return 1 / s_per_byte if s_per_byte else None


@dataclass
class LinkMeter:
    links: dict[str, Link] = field(default_factory=dict)
    compute: Decaying = field(default_factory=lambda: Decaying(HALF_TOKENS))  # s / token

    # ---- the wire ---------------------------------------------------------------------
    def begin(self, dest: str, now: float) -> None:
        """A measured write to `dest` (of a whole-prompt transfer) was sent."""
        ln = self.links.setdefault(dest, Link())
        if ln.in_flight == 0:
            ln.busy_since = now
        ln.in_flight += 1

    def end(self, dest: str, nbytes: int, now: float) -> None:
        """A write to `dest` was acked (nbytes: its payload; 0 when it failed)."""
        ln = self.links.get(dest)
        if ln is None or ln.in_flight == 0:
            return
        ln.in_flight -= 1
        ln.acc_bytes += nbytes
        if ln.in_flight:
            return
        if ln.acc_bytes and now > ln.busy_since:
            ln.busy.add(now - ln.busy_since, ln.acc_bytes)
            ln.streamed = 0
        ln.acc_bytes = 0

    def rate(self, dest: str) -> float | None:
        ln = self.links.get(dest)
        return ln.bytes_per_s if ln is not None else None

    # ---- the compute ------------------------------------------------------------------
    def computed(self, tokens: int, seconds: float) -> None:
        """A job's prompt of `tokens` computed in `seconds`."""
        if tokens > 0 and seconds > 0:
            self.compute.add(seconds, tokens)

    # ---- the choice -------------------------------------------------------------------
    def choose(self, dest: str, tokens: int, kv_bytes: int, min_share: float) -> tuple[bool, str]:
        """(stream?, why) for a job of `tokens` prompt tokens whose KV is `kv_bytes`."""
        rate, s_per_token = self.rate(dest), self.compute.ratio()
        if rate is None or s_per_token is None:
            return False, "unmeasured"
        wire_s = kv_bytes / rate
        compute_s = tokens * s_per_token
        why = f"wire {wire_s:.3f} s, compute {compute_s:.3f} s"
        if wire_s < min_share * compute_s:
            return False, why
        ln = self.links[dest]
        if ln.streamed + 1 >= REPROBE:
            ln.streamed = 0
            return False, "re-measure"
        ln.streamed += 1
        return True, why

    def report(self) -> dict[str, float]:
        """{decode instance: measured KV bytes/s} (for STATS)."""
        return {d: round(ln.bytes_per_s) for d, ln in self.links.items()
                if ln.bytes_per_s is not None}
