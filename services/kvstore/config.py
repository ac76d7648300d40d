"""Kvstore service settings (flags --foo-bar, env PDMESH_FOO_BAR)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from shared.natsconn import NatsAuth


@dataclass
class KvstoreConfig:
    """pdmesh kvstore: hierarchical KV cache (HiCache) tiers L2 (host memory) and L3 (disk)."""
    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsAuth = field(default_factory=NatsAuth, metadata={"prefix": "nats_"})   # identity, TLS
    otlp_endpoint: str = field(default="", metadata={"help": (
        "OpenTelemetry: export spans over OTLP/HTTP to this collector (http://host:4318); "
        "off when empty")})
    instance_id: str = field(default="", metadata={"help": "default: generated"})
    host_cache_mb: float = field(default=1024, metadata={"help": "L2 budget (0: no host tier)"})
    disk_cache_mb: float = field(default=4096, metadata={"help": "L3 budget (0: no disk tier)"})
    disk_dir: str = field(default=os.path.expanduser("~/.cache/pdmesh/kvstore"), metadata={
        "help": "L3 files live here (kept across restarts)"})
    write_through_l3: bool = field(default=False, metadata={
        "help": "write new blocks to disk at once (default: only when L2 evicts them)"})
    load_ttl_s: float = field(default=30.0, metadata={
        "help": "an opened load nobody finishes is dropped after this long"})

    def __post_init__(self):
        if self.host_cache_mb < 0 or self.disk_cache_mb < 0:
            raise ValueError("cache budgets must be >= 0")
