"""A replicated NATS (issue 13): three clustered nats-servers, the prefill job queue
replicated R3 with limits, every client given every URL, one node killed and restarted,
and a job stream whose store is lost re-created by the first publish. Real nats-servers;
kvstore is the only service (no model needed); the whole mesh: tests/e2e/test_nats_cluster.py.
"""
from __future__ import annotations

import asyncio

import nats
import pytest

from pdmesh.local.cluster import Cluster
from shared import jobqueue, jobstream, micro, subjects

pytestmark = pytest.mark.timeout(120)


async def _until(pred, timeout_s: float = 20.0, every_s: float = 0.2):
    """Poll an async predicate until it holds (state, not sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = await pred()
        if got:
            return got
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(every_s)


async def _fetch_all(puller, n: int, timeout_s: float = 30.0) -> list[bytes]:
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(got) < n and loop.time() < deadline:
        try:
            for m in await puller.fetch(1, timeout=1.0):
                got.append(m.data)
                await m.ack()
        except Exception:  # noqa: BLE001 - timeouts, elections: try again
            pass
    return got


async def test_three_nodes_replicate_the_job_queue_and_survive_a_node():
    async with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False,
                       nats_cluster=3, nats_auth=False) as c:   # one client: decode + prefill
        assert c.nats_names() == ["nats-0", "nats-1", "nats-2"]
        assert len(c.nats_servers) == 3 and c.nats_url == ",".join(c.nats_servers)
        conf = (c.tmp / "nats-0.conf").read_text()
        assert "routes" in conf and "max_payload: 8MB" in conf and "jetstream-0" in conf
        kv = c.procs["kvstore-0"]
        assert f"--nats-url {c.nats_url}" in " ".join(kv.argv)    # every URL

        nc = await nats.connect(servers=c.nats_servers)
        js = nc.jetstream()
        assert nc.max_payload == 8 << 20
        assert await jobstream.ensure_stream(js) == 3
        info = await js.stream_info(subjects.PREFILL_STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster.leader and len(info.cluster.replicas) == 2     # + the leader
        cfg = info.config
        assert (cfg.max_msgs, cfg.max_bytes, cfg.max_msg_size) == (
            jobstream.MAX_MSGS, jobstream.MAX_BYTES, jobstream.MAX_MSG_SIZE)
        assert cfg.discard == "new"          # a full queue refuses, never drops jobs
        puller = await jobqueue.pull_subscription(js, 10.0, 5, 4)
        await jobqueue.publish_job(js, b"before")

        leader = info.cluster.leader
        c.kill(leader)                              # SIGKILL the stream's leader
        for i in range(5):
            await jobqueue.publish_job(js, b"after-%d" % i)
        got = await _fetch_all(puller, 6)
        assert sorted(got) == sorted([b"before"] + [b"after-%d" % i for i in range(5)])
        info = await js.stream_info(subjects.PREFILL_STREAM)
        assert info.cluster.leader != leader and info.config.num_replicas == 3
        found = await micro.ping(nc, "kvstore")    # kvstore failed over to a live node
        assert [i.instance_id for i in found] == ["kvstore_0"]

        await c.arestart(leader)                    # back on the same ports and store

        async def caught_up():
            i = await js.stream_info(subjects.PREFILL_STREAM)
            return all(p.current for p in i.cluster.replicas) and len(i.cluster.replicas) == 2
        await _until(caught_up, 30)
        assert c.unexpected_exits() == []
        await nc.close()


async def test_job_stream_is_recreated_when_its_store_is_lost():
    async with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False,
                       nats_auth=False) as c:    # one client plays decode and prefill
        assert c.nats_names() == ["nats"]
        nc = await nats.connect(c.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream()
        puller = await jobqueue.pull_subscription(js, 10.0, 5, 4)
        assert await jobstream.ensure_stream(js) == 1
        await c.arestart_nats(down_s=0.2, wipe_store=True)     # the disk is gone

        async def stream_gone():
            # the keeper may re-create it before this client is back (a loaded machine
            # reconnects it late): its repair is the proof the store went
            if c.keeper.repairs >= 1:
                return True
            try:
                await js.stream_info(subjects.PREFILL_STREAM)
            except jobstream.NotFoundError:
                return True
            except Exception:  # noqa: BLE001 - still reconnecting
                return False
            return False
        await _until(stream_gone)
        ack = await jobqueue.publish_job(js, b"job")   # waits: the keeper re-creates it
        assert ack.stream == subjects.PREFILL_STREAM
        assert await _fetch_all(puller, 1) == [b"job"]       # and the puller its consumer
        assert puller.repairs >= 1 and c.keeper.repairs >= 1
        await nc.close()


async def test_publish_retries_are_deduplicated():
    async with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False,
                       nats_auth=False) as c:    # one client plays decode and prefill
        nc = await nats.connect(c.nats_url)
        js = nc.jetstream()
        await jobstream.ensure_stream(js)
        first = await jobqueue.publish_job(js, b"x", msg_id="job-1")
        again = await jobqueue.publish_job(js, b"x", msg_id="job-1")   # a retry after a lost ack
        assert again.duplicate and again.seq == first.seq
        info = await js.stream_info(subjects.PREFILL_STREAM)
        assert info.state.messages == 1
        await nc.close()
