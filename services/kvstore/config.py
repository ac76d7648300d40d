"""Kvstore service settings (flags --foo-bar, env PDMESH_FOO_BAR)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvstoreConfig:
    """pdmesh kvstore: hierarchical KV cache (HiCache) tiers and prefix index."""
    nats_url: str = "nats://127.0.0.1:4222"
    instance_id: str = field(default="", metadata={"help": "default: generated"})
