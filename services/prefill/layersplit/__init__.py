"""LayerSplit (issue 15): a prefill group sharing one layer-sharded prefix cache.

group.py the group (lookups, layer-wise loads, inserts), shard.py one rank's share of the
store, comm.py the point-to-point wire, membership.py rendezvous and generations,
config.py the settings (nested in PrefillConfig as --group-*).
"""
from __future__ import annotations

from .config import LayerSplitConfig
from .group import LayerSplitGroup

__all__ = ["LayerSplitConfig", "LayerSplitGroup", "build", "lookup"]


def build(cfg, engine) -> LayerSplitGroup | None:
    """The prefill's group (cfg: PrefillConfig), or None when LayerSplit is off."""
    if not cfg.group.enabled:
        return None
    return LayerSplitGroup(cfg.group, engine, delay_s=cfg.faults.group_delay_s)


async def lookup(group: LayerSplitGroup | None, kvc, keys: list[bytes],
                 known: int | None = None):
    """(leading blocks a lower tier holds, the loader that fills them): the group when it
    holds at least as much as kvstore (kvc None: kvstore off), kvstore otherwise. known:
    what kvstore held when decode looked (PrefillJob.kvstore_blocks): not asked again."""
    held = group.lookup(keys) if group is not None else 0
    tier = 0
    if kvc is not None and held < len(keys):
        tier = min(known, len(keys)) if known is not None else await kvc.lookup(keys)
    return (held, group) if group is not None and held and held >= tier else (tier, kvc)
