"""Cluster supervision against a real nats-server: readiness, status, restarts, clean stop.

Runs only kvstore (no model needed); the whole mesh is exercised by the e2e tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from pdmesh.local.cluster import Cluster, ClusterError
from shared import micro
from shared.service import new_instance_id

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(90)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read()
    except FileNotFoundError:
        return True


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_kvstore_cluster_starts_answers_survives_nats_restart_and_stops_clean():
    lines: list[str] = []
    iid = new_instance_id("kvstore")    # generated ids name the host: compose's health check
    with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=lines.append,
                 overrides={"kvstore": {"instance_id": iid}}) as c:
        assert set(c.procs) == {"nats", "kvstore-0"}
        r = _cli("status", "--nats-url", c.nats_url)
        assert r.returncode == 0 and iid in r.stdout, r.stdout + r.stderr
        hc = [sys.executable, "-m", "pdmesh.deploy.healthcheck", "kvstore", "--nats-url", c.nats_url]
        env = {k: v for k, v in os.environ.items() if k != "PDMESH_INSTANCE_ID"}
        assert subprocess.run(hc, env=env, timeout=30).returncode == 0      # found by hostname
        assert subprocess.run(hc + ["--instance-id", iid], timeout=30).returncode == 0
        assert subprocess.run(hc + ["--instance-id", "kvstore_9", "--timeout", "1"],
                              timeout=30).returncode == 1

        c.restart_nats(down_s=0.3)
        c.wait_ready(30)      # kvstore reconnected and registered again
        assert c.unexpected_exits() == []

        c.kill("kvstore-0")
        c.restart("kvstore-0")
        assert c.procs["kvstore-0"].starts == 2
        pids, tmp = [p.pid for p in c.procs.values()], c.tmp
    assert any(line.startswith("[kvstore-0] ") for line in lines)
    assert all(_gone(pid) for pid in pids)
    assert not tmp.exists()


def test_child_that_dies_during_startup_raises_with_its_last_lines():
    c = Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False,
                overrides={"kvstore": {"instance_id": "Not.A.Token"}})
    with pytest.raises(ClusterError, match="kvstore-0 exited") as err:
        c.start()
    assert "bad subject token" in str(err.value)
    assert all(_gone(p.pid) for p in c.procs.values())


def test_unknown_setting_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="kvstore has no setting"):
        Cluster(model="unused", overrides={"kvstore": {"num_blocks": 4}})


def test_instance_overrides_apply_to_that_instance_only():
    c = Cluster(model="unused", decode=2, echo=False,
                overrides={"decode": {"num_blocks": 64}, "decode-0": {"fault_repeat_loop": True}})
    first, second = c.new_proc("decode"), c.new_proc("decode")   # argv only, not started
    assert "--fault-repeat-loop" in first.argv and "--fault-repeat-loop" not in second.argv
    assert all("--num-blocks" in p.argv for p in (first, second))
    with pytest.raises(ValueError, match="unknown service or instance"):
        Cluster(model="unused", overrides={"decode-x": {}})
    with pytest.raises(ValueError, match="decode has no setting"):
        Cluster(model="unused", overrides={"decode-1": {"bogus": 1}})


async def test_async_context_manager_does_not_block_the_loop():
    async with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False) as c:
        await c.arestart_nats()
        await c.await_ready(30)
        assert os.path.exists(c.tmp / "nats.conf")
        # $SRV.STATS through shared.micro, by URL: per instance, first answer, summed
        per = await micro.service_stats(c.nats_url, "kvstore")
        assert len(per) == 1 and per[0]
        t0 = time.monotonic()
        assert len(await micro.service_stats(c.nats_url, "kvstore", wait_s=20, expect=1)) == 1
        assert time.monotonic() - t0 < 10          # expect=1 stops waiting at the answer
        nc = await nats.connect(**c.client_options())    # so does a ping (readiness uses it)
        try:
            t0 = time.monotonic()
            found = await micro.ping(nc, "kvstore", wait_s=20, expect=1)
            assert [i.instance_id for i in found] == ["kvstore_0"]
            assert time.monotonic() - t0 < 10
        finally:
            await nc.close()
        total = await micro.total_stats(c.nats_url, "kvstore")
        assert total and set(total) <= set(per[0])


def test_stats_sum_numbers_only():
    assert micro.sum_stats([{"a": 1, "b": 2.5, "up": True, "name": "x", "h": {"p50": 1}},
                            {"a": 2, "c": None}]) == {"a": 3, "b": 2.5}
