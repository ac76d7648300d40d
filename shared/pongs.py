"""A PONG for a flush nobody awaits any more must not stop the NATS client reading.

nats-py (2.16, and its main branch today) keeps one future per PING sent and, when a PONG
arrives, pops the oldest and sets its result. A `flush()` whose task was cancelled (a
timeout around `micro.collect`, a scrape or a shutdown) or that timed out leaves its future
cancelled in that list; the PONG then raises InvalidStateError inside the client's read
loop, which logs "nats: encountered error" and stops: the connection reads nothing more
(no message, no reply) until the PING timer calls it stale and reconnects (3 s in pdmesh's
services, 4 minutes under nats-py's defaults). Seen in make test under load: a gateway's
teardown logged it, and a client waiting 20 s on a JetStream answer got none.

install() (connect_kwargs calls it: every pdmesh connection) replaces `_process_pong` by the
same steps with a done future skipped (nats.py issue 624 is the same bug in its flusher)."""
from __future__ import annotations

from nats.aio.client import Client


async def _process_pong(self: Client) -> None:
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():            # cancelled: its flush() is gone, the PONG is still its
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


def install() -> None:
    Client._process_pong = _process_pong
