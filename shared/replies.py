"""A pdmesh service answers requests on inboxes only.

A NATS requester names the subject its reply goes to. With nats-server's allow_responses
that let the read-only debug user make services publish onto token, abort, KV and job
subjects (issue 29); the servers now let each service publish replies only to its
callers' inboxes, `_INBOX.<caller>.>` (shared/subjects.py REPLIES_TO). That still leaves
the subjects a service may publish anyway (decode: token chunks, jobs): a Health reply
aimed at `pdmesh.gateway.tokens.*` would pass the server. So every reply a pdmesh
process sends, through nats-py's Msg.respond or nats.micro's Request.respond (the $SRV
PING/INFO/STATS answers, every endpoint), is dropped unless its subject is an inbox.

    install()        # once per process, before serving (shared/service.py does)
"""
from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.micro.request import Request

from .natsconn import INBOX

log = logging.getLogger("pdmesh.replies")
refused = 0              # replies dropped (a counter for tests and logs)


def answerable(reply: str) -> bool:
    return reply.startswith(INBOX + ".")


def _refuse(reply: str) -> None:
    global refused
    refused += 1
    log.warning("not answering a request whose reply subject %r is not an inbox", reply[:200])


def install() -> None:
    if getattr(Msg.respond, "_pdmesh_inbox_only", False):
        return
    msg_respond, req_respond = Msg.respond, Request.respond

    async def respond_msg(self, data: bytes) -> None:
        if self.reply and not answerable(self.reply):
            return _refuse(self.reply)
        await msg_respond(self, data)

    async def respond_req(self, data: bytes = b"", headers=None) -> None:
        reply = self._msg.reply
        if reply and not answerable(reply):
            return _refuse(reply)
        await req_respond(self, data, headers=headers)

    respond_msg._pdmesh_inbox_only = True
    Msg.respond, Request.respond = respond_msg, respond_req
