"""One config object per service, filled from flags, then env, then defaults.

A dataclass field `foo_bar` is the flag `--foo-bar` and the env var `PDMESH_FOO_BAR`;
bools are `--foo-bar/--no-foo-bar`. Help text comes from field metadata["help"].
compose.yaml and `pdmesh up` use exactly these names (a test checks them).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")


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
    import types

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _caster(args[0])
    return {bool: _parse_bool}.get(tp, tp)


def parser_for(cls: type, prog: str | None = None) -> argparse.ArgumentParser:
    hints = typing.get_type_hints(cls)
    ap = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0])
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        help_ = f.metadata.get("help", "") + f" (env {env_name(f.name)})"
        if tp is bool:
            ap.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                            default=None, help=help_)
        else:
            ap.add_argument(flag_name(f.name), dest=f.name, type=_caster(tp), default=None,
                            help=help_)
    return ap


def load(cls: type[T], argv: list[str] | None = None, prog: str | None = None) -> T:
    """Build cls from argv (None: sys.argv[1:]), then PDMESH_* env, then defaults."""
    hints = typing.get_type_hints(cls)
    args = vars(parser_for(cls, prog).parse_args(argv))
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if args.get(f.name) is not None:
            kw[f.name] = args[f.name]
        elif env_name(f.name) in os.environ:
            kw[f.name] = _caster(hints[f.name])(os.environ[env_name(f.name)])
    return cls(**kw)


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
