"""Two fixes to nats-py's PING/PONG bookkeeping, installed on every pdmesh connection.

1. A PONG for a flush nobody awaits any more must not stop the NATS client reading.

nats-py (2.16, and its main branch today) keeps one future per PING sent and, when a PONG
arrives, pops the oldest and sets its result. A `flush()` whose task was cancelled (a
timeout around `micro.collect`, a scrape or a shutdown) or that timed out leaves its future
cancelled in that list; the PONG then raises InvalidStateError inside the client's read
loop, which logs "nats: encountered error" and stops: the connection reads nothing more
(no message, no reply) until the PING timer calls it stale and reconnects (3 s in pdmesh's
services, 4 minutes under nats-py's defaults). Seen in make test under load: a gateway's
teardown logged it, and a client waiting 20 s on a JetStream answer got none.

install() (connect_kwargs calls it: every pdmesh connection) replaces `_process_pong` by the
same steps with a done future skipped (nats.py issue 624 is the same bug in its flusher).

2. flush() must mean "the server has what I sent before it". nats-py writes a flush's PING
straight to the socket while the commands before it (a SUB, a PUB) still wait in its
pending buffer for the flusher task: under load the server answers the PONG before it has
read them, so `await sub = nc.subscribe(s); await nc.flush()` returns with the
subscription not yet there, and a request right after it gets "no responders" (seen in
make test: 1 in 12 runs of a request/reply test on a loaded machine). `_send_ping` here
queues the PING behind them in the same buffer."""
from __future__ import annotations

import asyncio

from nats.aio.client import PING_PROTO, Client


async def _process_pong(self: Client) -> None:
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():            # cancelled: its flush() is gone, the PONG is still its
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


async def _send_ping(self: Client, future: asyncio.Future | None = None) -> None:
    self._pongs.append(future if future is not None else asyncio.Future())
    await self._send_command(PING_PROTO)      # in order: after what is pending before it
    await self._flush_pending()


def install() -> None:
    Client._process_pong = _process_pong
    Client._send_ping = _send_ping
