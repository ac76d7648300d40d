"""Service settings given to `pdmesh up` ({service: {field: value}}): `K=V` and
`SERVICE.FIELD=V` command-line values, layering them, checking their names (with the
closest valid one), and listing every settable field (`pdmesh config`)."""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

Overrides = dict[str, dict[str, Any]]
TEST_ONLY = "fault_"          # the test-only faults' flat names: never listed


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


def merge(*layers: Overrides) -> Overrides:
    """Later layers win, field by field."""
    out: Overrides = {}
    for layer in layers:
        for key, kv in layer.items():
            out.setdefault(key, {}).update(kv)
    return out


def check(overrides: Overrides) -> None:
    """ValueError, one line naming the closest valid name, for a service, instance or
    field that does not exist."""
    from pdmesh.local.launch import CONFIG_CLASSES, known_settings

    for key, kv in overrides.items():
        service, _, index = key.partition("-")
        if service not in CONFIG_CLASSES or (index and not index.isdigit()):
            close = difflib.get_close_matches(service, sorted(CONFIG_CLASSES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"no service or instance {key!r}; {hint}(services: "
                             f"{', '.join(sorted(CONFIG_CLASSES))}; an instance: decode-0)")
        known_settings(service, kv)


# ---- pdmesh config -------------------------------------------------------------------------
def describe(service: str) -> list[str]:
    """Every settable field of a service as `service.field = default` and its help on the
    next line (the test-only faults left out)."""
    from pdmesh.local.launch import config_class
    from shared.settings import settings_of

    cls = config_class(service)
    lines = [f"# {service}: {(cls.__doc__ or '').strip().splitlines()[0]}"]
    for st in settings_of(cls):
        if st.name.startswith(TEST_ONLY):
            continue
        lines.append(f"{service}.{st.name} = {_shown(_default(cls, st.path))}")
        if st.help:
            lines.append(f"    {st.help}")
    return lines


def _default(cls: type, path: tuple[str, ...]) -> Any:
    """A field's default without building cls (a required field has none: MISSING)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == path[0])
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return dataclasses.MISSING
    for attr in path[1:]:
        value = getattr(value, attr)
    return value


def _shown(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return json.dumps(value)
    return str(value)
