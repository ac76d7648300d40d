"""kvstore refuses prefix keys that are not 16 bytes: a key names a file under the L3
directory, and an empty one named the directory itself, so a put's temp file went into the
directory's parent (issue 29). A real nats-server and a real kvstore; the put as prefill
would send it."""
from __future__ import annotations

import asyncio

import nats
import pytest
import torch

from services.kvstore.config import KvstoreConfig
from services.kvstore.service import KvstoreService
from shared import subjects
from shared.contracts.kvcache import KvPut
from shared.kv import wire
from tests import natsserver

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def nats_url(tmp_path):
    proc, port = natsserver.start()
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


async def _put(nc, key: str):
    snap = torch.randn(1, 2, 2, 4, 2, 8)                # one block, 2 layers
    payload, sums = wire.pack_put(snap, 0, 1)
    meta = KvPut(keys=[key], num_layers=2, layer_bytes=len(payload) // 2, checksums=sums)
    return await nc.request(subjects.kvstore_put(), bytes(payload), headers=meta.headers(),
                            timeout=10)


@pytest.mark.parametrize("key", ["", "00", "ab" * 17, "zz" * 16])
async def test_a_key_that_is_not_16_bytes_is_refused_and_nothing_is_written(nats_url, tmp_path,
                                                                           key):
    l3 = tmp_path / "cache" / "l3"
    kv = KvstoreService(KvstoreConfig(nats_url=nats_url, disk_dir=str(l3),
                                      write_through_l3=True))
    for _ in range(50):
        try:
            await kv.start()
            break
        except Exception:  # noqa: BLE001 - server starting
            await asyncio.sleep(0.1)
    nc = await nats.connect(nats_url)
    try:
        r = await _put(nc, key)
        assert r.headers["Nats-Service-Error-Code"].startswith("4"), r.headers
        assert "bad prefix key" in r.headers.get("Nats-Service-Error", "")
        assert kv.counters["blocks_stored"] == 0
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["l3"]
        ok = await _put(nc, "ab" * 16)                  # a real key is still stored
        assert "Nats-Service-Error-Code" not in (ok.headers or {}), ok.headers
        assert kv.counters["blocks_stored"] == 1
    finally:
        await nc.close()
        await kv.rt.close()
        kv.io.shutdown(wait=True)
