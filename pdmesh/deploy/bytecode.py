"""Bytecode for what the services load, written while the image is built.

The image's venv and /app belong to root, and the services run as their own user, so a
service cannot write bytecode: whatever has none is compiled again at every start. pip
installs with --no-compile (byte-compiling all of torch and transformers, most of which no
service imports, took 42 of the install's 55 s here and 300 MB of the image); this imports
what the four services, their health check and their engine load, which writes exactly
that bytecode (tests/e2e/test_compose_up.py checks that none is missing).

    python -m pdmesh.deploy.bytecode MODEL_DIR
"""
from __future__ import annotations

import importlib
import sys

MODULES = ("services.gateway.__main__", "services.prefill.__main__",
           "services.decode.__main__", "services.kvstore.__main__",
           "pdmesh.deploy.healthcheck", "pdmesh.deploy.streamkeeper", "pdmesh.cli")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for name in MODULES:
        importlib.import_module(name)
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    # the model as a service loads it: weights, tokenizer, the quantized matmuls
    LLMEngine(EngineConfig(model=args[0], num_blocks=16))
    print(f"bytecode: {len(sys.modules)} modules loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
