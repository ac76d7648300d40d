"""What each service and each instance of a local mesh is started with: its settings from
the launcher's arguments, overrides and --threads auto, checked before anything starts."""
from __future__ import annotations

from typing import Any

from pdmesh.local.launch import known_settings, split_overrides
from pdmesh.local.prefill_group import group_settings
from pdmesh.local.threads import resolve_threads


def plan(model: str, counts: dict[str, int], overrides, threads, prefill_group: int,
         engine: dict[str, Any], mode: str | None
         ) -> tuple[dict[str, dict[str, Any]], dict[str, dict]]:
    """(each service's settings, each instance's own: "decode-0"). counts: instances per
    service; a LayerSplit group may change counts["prefill"]. ValueError for a setting a
    service does not have."""
    prefill, decode = counts["prefill"], counts["decode"]
    settings: dict[str, dict[str, Any]] = {
        "gateway": {"model": model},
        "decode": {"model": model, **engine, "threads": threads, "mode": mode,
                   "require_prefill": prefill > 0},   # ready means PD is usable too
        "prefill": {"model": model, **engine, "threads": threads},
        "kvstore": {},
    }
    per_instance = split_overrides(overrides, settings)
    counts["prefill"] = group_settings(per_instance, prefill, prefill_group)
    if threads == "auto":   # the host's cores divided among the engine instances
        settings["decode"]["threads"] = settings["prefill"]["threads"] = None
        for key, n in resolve_threads(threads, counts["prefill"], decode).items():
            per_instance.setdefault(key, {}).setdefault("threads", n)
    for service, kv in settings.items():
        if counts[service] or service in (overrides or {}):
            known_settings(service, kv | {"nats_url": "", "instance_id": ""})
    for key, kv in per_instance.items():
        known_settings(key.partition("-")[0], kv)
    return settings, per_instance
