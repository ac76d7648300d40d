"""One config object per service, filled from flags, then env, then defaults; and the one
`main` every service's `python -m services.<name>` runs.

A dataclass field `foo_bar` is the flag `--foo-bar` and the env var `PDMESH_FOO_BAR`;
bools are `--foo-bar/--no-foo-bar`. Help text comes from field metadata["help"]. A str
field with metadata["repeat"] takes its flag several times (joined with commas, like its
comma-separated env var: `--api-key a --api-key b` == `PDMESH_API_KEY=a,b`). A field
whose value is itself a settings dataclass (the engine's settings in decode and prefill,
a service's test-only faults) is flattened: its fields become flags of the service, named
with the field's metadata["prefix"] ("" for the engine, "fault_" for faults), and its
default instance gives the service's own defaults. compose.yaml and `pdmesh up` use
exactly these names (a test checks them).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("pdmesh")


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    name: str                       # flat name: the flag and env var
    path: tuple[str, ...]           # attribute path in the config object
    type: Any
    help: str
    repeat: bool = False            # a repeatable flag, joined with "," (str fields)


def env_name(field: str) -> str:
    return "PDMESH_" + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _caster(tp) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _caster(args[0])
    return {bool: _parse_bool}.get(tp, tp)


def _nested(f: dataclasses.Field, tp) -> bool:
    return dataclasses.is_dataclass(tp) and "prefix" in f.metadata


def settings_of(cls: type, prefix: str = "", path: tuple[str, ...] = ()) -> Iterator[Setting]:
    """Every flat setting of a config class, nested settings flattened."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.metadata.get("flag") is False:     # set by the service, never by a flag
            continue
        if _nested(f, tp):
            yield from settings_of(tp, prefix + f.metadata["prefix"], (*path, f.name))
        else:
            yield Setting(prefix + f.name, (*path, f.name), tp, f.metadata.get("help", ""),
                          bool(f.metadata.get("repeat")))


def field_names(cls: type) -> set[str]:
    return {s.name for s in settings_of(cls)}


def flat_values(cfg) -> dict[str, Any]:
    """{flat name: value} of a config object (the inverse of build)."""
    out = {}
    for st in settings_of(type(cfg)):
        v = cfg
        for attr in st.path:
            v = getattr(v, attr)
        out[st.name] = v
    return out


def parser_for(cls: type, prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0])
    for s in settings_of(cls):
        help_ = s.help + f" (env {env_name(s.name)})"
        if s.type is bool:
            ap.add_argument(flag_name(s.name), dest=s.name, action=argparse.BooleanOptionalAction,
                            default=None, help=help_)
        elif s.repeat:
            ap.add_argument(flag_name(s.name), dest=s.name, action="append", default=None,
                            help=help_ + " (repeatable)")
        else:
            ap.add_argument(flag_name(s.name), dest=s.name, type=_caster(s.type), default=None,
                            help=help_)
    return ap


def build(cls: type[T], values: dict[str, Any]) -> T:
    """cls from flat values ({"block_size": 32, "fault_repeat_loop": True}); unset
    settings keep the class's (and its nested defaults') values."""
    by_path: dict[tuple[str, ...], Any] = {s.path: values[s.name] for s in settings_of(cls)
                                           if s.name in values}
    return _build(cls, by_path, ())


def _build(cls: type, by_path: dict, path: tuple[str, ...], default=None):
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        p = (*path, f.name)
        if _nested(f, hints[f.name]):
            inner = getattr(default, f.name) if default is not None else f.default_factory()
            kw[f.name] = _build(hints[f.name], by_path, p, inner)
        elif p in by_path:
            kw[f.name] = by_path[p]
    if default is not None:
        return dataclasses.replace(default, **kw)
    return cls(**kw)


def load(cls: type[T], argv: list[str] | None = None, prog: str | None = None) -> T:
    """Build cls from argv (None: sys.argv[1:]), then PDMESH_* env, then defaults."""
    args = vars(parser_for(cls, prog).parse_args(argv))
    values: dict[str, Any] = {}
    for s in settings_of(cls):
        if args.get(s.name) is not None:
            v = args[s.name]
            values[s.name] = ",".join(v) if isinstance(v, list) else v
        elif env_name(s.name) in os.environ:
            values[s.name] = _caster(s.type)(os.environ[env_name(s.name)])
    return build(cls, values)


def service_main(name: str, config_cls: type, serve: Callable[[Any], Any],
                 argv: list[str] | None = None) -> int:
    """`python -m services.<name>`: settings, then the coroutine serve(cfg) returns, on
    uvloop until SIGTERM. A bad setting (or serve raising ValueError/OSError before it
    returns its coroutine) exits 2 with one clear line, never a traceback."""
    from shared import tracing
    from shared.service import setup_logging

    setup_logging(name)
    try:
        cfg = load(config_cls, argv, prog=f"python -m services.{name}")
        tracing.configure(getattr(cfg, "otlp_endpoint", ""), name)     # off unless set
        main = serve(cfg)
    except (ValueError, OSError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        uvloop.run(main)
    finally:
        tracing.shutdown()                                          # flush batched spans
    return 0
