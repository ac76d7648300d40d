"""`pdmesh up/serve --config FILE`: a TOML (.toml) or YAML (any other name) file of settings.

    [serve]                  # the flags of up/serve, by their long names
    quantization = "int8"
    max-model-len = 2048
    [decode]                 # any field of a service (`pdmesh config decode` lists them)
    num_blocks = 64
    [decode-0]               # or of one instance
    threads = 2

Flags given on the command line, and --set, win over the file.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

SERVE_TABLE = "serve"


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the serve table, {service or instance: {field: value}}), or ValueError naming the
    file and what is wrong with it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    data = _parse(path, text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected tables (service: {{field: value}})")
    serve = data.pop(SERVE_TABLE, None) or {}
    for key, table in [(SERVE_TABLE, serve), *data.items()]:
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: {key!r} must be a table of field = value "
                             f"(flags go in the [{SERVE_TABLE}] table)")
    return serve, {k: {f.replace("-", "_"): v for f, v in t.items()} for k, t in data.items()}


def _parse(path: Path, text: str) -> Any:
    if path.suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: {e}") from None
    try:
        import yaml
    except ImportError:
        raise ValueError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml); "
                         "or write the file as TOML (.toml)") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: {' '.join(str(e).split())}") from None
