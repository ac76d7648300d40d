"""A job whose PubAck is lost (the connection cut after the job reached the stream, as when
a NATS node dies under decode) is published again after a short first wait, stored once
(the stream deduplicates by the job's message id) and answered. Before, every try waited
5 s for its ack: a job queued as a node died reached prefill 11 s later. Real nats-server
with JetStream; between it and the client a TCP relay that cuts the connection right
after forwarding the job, so the server's PubAck goes to a closed connection."""
from __future__ import annotations

import asyncio
import logging

import nats

from shared import jobqueue, jobstream, subjects
from shared.natsconn import connect_kwargs
from tests import natsserver


class CuttingRelay:
    """Forwards TCP to the server; with cut_next set, forwards the next job publication,
    drops whatever the server sends back, and closes the client's connection."""

    def __init__(self, upstream: int):
        self.upstream, self.cut_next, self.cuts = upstream, False, 0
        self.dropping = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, cr, cw) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pump(r, w, watch: bool) -> None:
            try:
                while data := await r.read(65536):
                    job = watch and self.cut_next and subjects.prefill_jobs().encode() in data
                    if job:
                        self.cut_next, self.dropping = False, True
                    if watch or not self.dropping:
                        w.write(data)
                        await w.drain()
                    if job:
                        await asyncio.sleep(0.2)    # the server stores it, its ack dropped
                        self.cuts += 1
                        break
            except (ConnectionError, OSError):
                pass
            self.dropping = False
            for x in (cw, sw):
                x.close()
        await asyncio.gather(pump(cr, sw, True), pump(sr, cw, False))


async def test_a_lost_pub_ack_costs_one_short_try_and_the_job_is_stored_once(caplog, tmp_path):
    server, port = natsserver.start("-js", "-sd", str(tmp_path))
    try:
        for _ in range(50):
            try:
                admin = await nats.connect(**connect_kwargs(f"nats://127.0.0.1:{port}"))
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                await asyncio.sleep(0.1)
        await jobstream.ensure_stream(admin.jetstream())
        relay = CuttingRelay(port)
        via = await relay.start()
        nc = await nats.connect(**connect_kwargs(f"nats://127.0.0.1:{via}"),
                                reconnect_time_wait=0.1, max_reconnect_attempts=-1)
        caplog.set_level(logging.INFO, logger="pdmesh.jobqueue")
        relay.cut_next = True
        ack = await jobqueue.publish_job(nc.jetstream(), b"job", msg_id="job-1")
        info = await admin.jetstream().stream_info(subjects.PREFILL_STREAM)
        retries = [r.getMessage() for r in caplog.records if "no PubAck" in r.getMessage()]
        await nc.close()
        await admin.close()
        relay.server.close()
    finally:
        server.terminate()
        server.wait(10)
    assert relay.cuts == 1
    assert ack.duplicate and info.state.messages == 1      # the first try landed, once
    assert retries and retries[0].startswith("no PubAck for a job in 1.0 s"), retries
