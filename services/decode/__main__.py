"""python -m services.decode [flags] — see services/decode/config.py."""
from __future__ import annotations

import sys

from shared.service import setup_logging
from shared.settings import load

from .config import DecodeConfig
from .service import DecodeService


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = load(DecodeConfig, argv, prog="python -m services.decode")
    import uvloop

    uvloop.run(DecodeService(cfg).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
