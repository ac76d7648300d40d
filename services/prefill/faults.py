"""TEST ONLY fault settings of prefill (flags --fault-*), refused unless
PDMESH_ALLOW_FAULTS=1 (shared/faults.py). Each is applied by wrapping a part when the
service is built (inject.py), never by a branch in the job path."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefillFaults:
    load_delay_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: each layer loaded from kvstore lands a random 0..this late"})
    no_load_guard: bool = field(default=False, metadata={
        "help": "TEST ONLY: compute reads a loading layer without waiting for it"})
    delay_before_kv_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: sleep this long between computing a job and sending its KV"})
    kv_write_delay_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: each KV write waits a random 0..this long once issued (slow wire)"})
    group_delay_s: float = field(default=0.0, metadata={
        "help": "TEST ONLY: each layer fetched from a LayerSplit peer lands this much late"})
