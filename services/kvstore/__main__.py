"""python -m services.kvstore [flags] — see services/kvstore/config.py."""
from __future__ import annotations

import sys

from shared.service import setup_logging
from shared.settings import load

from .config import KvstoreConfig
from .service import KvstoreService


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = load(KvstoreConfig, argv, prog="python -m services.kvstore")
    import uvloop

    uvloop.run(KvstoreService(cfg).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
