"""A/B runs of a benchmark script's child, alternating: each configuration (a set of
environment variables the child reads at load) in a process of its own, round after round,
so that a machine's drift lands on every configuration alike. The child prints its result
as JSON on its last line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def alternate(script: str | Path, child_args: list[str], configs: dict[str, dict[str, str]],
              rounds: int, log: Callable[[str], None],
              show: Callable[[dict], str]) -> dict[str, list[dict]]:
    """{config: [each round's result]}; `python script --child *child_args` per run."""
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(rounds):
        for name, env in configs.items():
            log(f"round {r + 1}/{rounds}: {name}")
            p = subprocess.run([sys.executable, str(script), "--child", *child_args],
                               env={**os.environ, **env}, capture_output=True, text=True,
                               check=True, cwd=Path(script).resolve().parents[1])
            got = json.loads(p.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            log("  " + show(got))
    return runs
