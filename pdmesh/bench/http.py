"""Waiting for a server a benchmark started (llama-server, pdmesh up) to answer."""
from __future__ import annotations

import time
import urllib.request


def wait_http(url: str, path: str = "/v1/models", timeout: float = 600) -> None:
    """Until GET url+path answers 200; RuntimeError after timeout seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise RuntimeError(f"{url} did not come up")
