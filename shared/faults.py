"""TEST ONLY fault injection: the gate every service's fault settings pass.

Faults are settings of their own (a dataclass nested in a service's settings, flags
--fault-*), applied by wrapping a transport, the KV slots or a handler, never by branches
in the request path. A service refuses to start with any fault set unless
PDMESH_ALLOW_FAULTS=1 is in its environment, so a production deployment cannot switch one
on by a stray env var. The guard switches (epoch fence, reclaim-ack, load guard) are
faults too: each one turns a guard off, to show that its test fails without it.
"""
from __future__ import annotations

import dataclasses
import os

ALLOW_ENV = "PDMESH_ALLOW_FAULTS"


def active(faults) -> list[str]:
    """Names of the fault settings that differ from their defaults."""
    return [f.name for f in dataclasses.fields(faults)
            if getattr(faults, f.name) != (f.default if f.default is not dataclasses.MISSING
                                           else f.default_factory())]


def require_allowed(faults) -> None:
    on = active(faults)
    if on and os.environ.get(ALLOW_ENV) != "1":
        raise ValueError(f"TEST ONLY fault setting(s) {', '.join('fault_' + n for n in on)} "
                         f"refused: set {ALLOW_ENV}=1 to allow fault injection")
