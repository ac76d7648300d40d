"""python -m services.kvstore [flags] — see services/kvstore/config.py."""
import sys

from shared.settings import service_main

from .config import KvstoreConfig
from .service import KvstoreService

if __name__ == "__main__":
    sys.exit(service_main("kvstore", KvstoreConfig, lambda cfg: KvstoreService(cfg).serve()))
