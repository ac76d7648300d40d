"""python -m services.decode [flags] — see services/decode/config.py."""
import sys

from shared.settings import service_main

from .config import DecodeConfig
from .service import DecodeService

if __name__ == "__main__":
    sys.exit(service_main("decode", DecodeConfig, lambda cfg: DecodeService(cfg).serve()))
