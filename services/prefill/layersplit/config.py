"""LayerSplit settings, nested in the prefill service's (flags --group-size, --group-rank,
--group-addr, --group-cache-mb, --group-prefetch-layers, --group-heartbeat-s)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerSplitConfig:
    size: int = field(default=0, metadata={
        "help": "prefill ranks in this LayerSplit group (0: off; 1: one rank keeping every "
                "layer in its store, the unsplit layout)"})
    rank: int = field(default=0, metadata={"help": "this prefill's rank in its group"})
    addr: str = field(default="127.0.0.1:29500", metadata={
        "help": "host:port of the group's rendezvous store (rank 0 hosts it)"})
    cache_mb: float = field(default=64.0, metadata={
        "help": "bytes of this rank's layer-sharded prefix store (its owned layers only)"})
    prefetch_layers: int = field(default=2, metadata={
        "help": "remote layers requested ahead of compute (transfer of l+1.. overlaps l)"})
    heartbeat_s: float = field(default=0.5, metadata={
        "help": "group liveness beat; a rank silent 6x this long is taken as dead"})
    timeout_s: float = field(default=5.0, metadata={
        "help": "a group transfer or rendezvous slower than this fails (recompute)"})
    backend: str = field(default="", metadata={"help": "'' (gloo on CPU, nccl on CUDA) | gloo"})

    def __post_init__(self):
        if self.size < 0 or self.size and not 0 <= self.rank < self.size:
            raise ValueError(f"need size >= 1 and 0 <= rank < size, got {self.size}, {self.rank}")
        if self.prefetch_layers < 1:
            raise ValueError("prefetch_layers must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.size >= 1

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.addr.rpartition(":")
        return host or "127.0.0.1", int(port)
