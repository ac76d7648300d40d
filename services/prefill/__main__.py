"""python -m services.prefill [flags] — see services/prefill/config.py."""
import sys

from shared.settings import service_main

from .config import PrefillConfig
from .service import PrefillService

if __name__ == "__main__":
    sys.exit(service_main("prefill", PrefillConfig, lambda cfg: PrefillService(cfg).serve()))
