"""python -m services.prefill [flags] — see services/prefill/config.py."""
from __future__ import annotations

import sys

from shared.service import setup_logging
from shared.settings import load

from .config import PrefillConfig
from .service import PrefillService


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = load(PrefillConfig, argv, prog="python -m services.prefill")
    import uvloop

    uvloop.run(PrefillService(cfg).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
