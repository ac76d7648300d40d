"""`--threads auto`: the host's cores divided among the engine services `pdmesh up` starts.

Every prefill and decode instance is one process running torch; giving each the whole
machine oversubscribes it (their forwards contend and torch's worker threads spin), while
one thread each leaves cores idle on a big host. auto gives every engine instance
cores // instances threads (at least one), the remainder going to decode instances first
(decode steps are the latency a user sees). Explicit numbers pass through unchanged.
"""
from __future__ import annotations

import os


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def split_cores(cores: int, prefill: int, decode: int) -> dict[str, list[int]]:
    """Threads per instance: {"prefill": [...], "decode": [...]} summing to at most
    max(cores, prefill + decode)."""
    n = prefill + decode
    if n == 0:
        return {"prefill": [], "decode": []}
    each, extra = divmod(max(cores, n), n)
    order = [("decode", i) for i in range(decode)] + [("prefill", i) for i in range(prefill)]
    out = {"prefill": [each] * prefill, "decode": [each] * decode}
    for role, i in order[:extra]:
        out[role][i] += 1
    return out


def resolve_threads(threads, prefill: int, decode: int, cores: int | None = None
                    ) -> dict[str, int | None]:
    """Per-instance threads ("decode-0": 4, ...) for `threads`; {} unless it is "auto"."""
    if threads != "auto":
        return {}
    split = split_cores(cores or host_cores(), prefill, decode)
    return {f"{role}-{i}": t for role, ts in split.items() for i, t in enumerate(ts)}


def parse_threads(s: str):
    """argparse type for --threads: a positive int or 'auto'."""
    if s == "auto":
        return s
    n = int(s)
    if n < 0:
        raise ValueError("threads must be >= 0 or 'auto'")
    return n
