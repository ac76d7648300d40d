"""`K=V` and `SERVICE.FIELD=V` command-line values (pdmesh up, pdmesh bench --spawn)."""
from __future__ import annotations


def parse_kv(s: str) -> tuple[str, str]:
    if "=" not in s:
        raise SystemExit(f"expected K=V, got {s!r}")
    k, v = s.split("=", 1)
    return k, v


def parse_sets(sets: list[str]) -> dict[str, dict[str, str | bool]]:
    """["decode.num_blocks=64", "decode-0.fault_repeat_loop=true"] ->
    {"decode": {"num_blocks": "64"}, "decode-0": {"fault_repeat_loop": True}}"""
    bools = {"true": True, "false": False}
    out: dict[str, dict[str, str | bool]] = {}
    for s in sets:
        k, v = parse_kv(s)
        if "." not in k:
            raise SystemExit(f"expected SERVICE.FIELD=V, got {s!r}")
        service, field = k.split(".", 1)
        out.setdefault(service, {})[field.replace("-", "_")] = bools.get(v.lower(), v)
    return out
