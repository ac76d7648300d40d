"""LayerSplit groups for Cluster / `pdmesh up --prefill-group N`: prefill-0..N-1 form one
group (services/prefill/layersplit): the same size and rendezvous address, rank = index.
Instances past N (or added later) stay out of it."""
from __future__ import annotations

from typing import Any

from pdmesh.local.launch import free_port


def group_settings(instance_settings: dict[str, dict[str, Any]], prefill: int, size: int,
                   host: str = "127.0.0.1") -> int:
    """Set each group member's fields (without overriding any given); returns how many
    prefill instances to start (at least the group)."""
    if not size:
        return prefill
    addr = f"{host}:{free_port()}"
    for rank in range(size):
        own = instance_settings.setdefault(f"prefill-{rank}", {})
        for k, v in {"group_size": size, "group_rank": rank, "group_addr": addr}.items():
            own.setdefault(k, v)
    return max(prefill, size)
