"""What every pdmesh service shares: a NATS connection that survives server restarts,
a nats.micro registration (PING/INFO/STATS answer for `nats micro ls/info/stats`),
typed-error endpoints that never take the service down, heartbeats, and shutdown on
SIGTERM/SIGINT that drains.

    rt = ServiceRuntime("decode", instance_id, nats_url, stats=lambda: {...})
    await rt.start()
    await rt.endpoint("submit", subjects.decode_submit(iid), on_submit, Codec(DecodeSubmit))
    await rt.run(heartbeat=lambda: Heartbeat(...))
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
from nats.micro import add_service
from nats.micro.request import Request

from shared import logs, replies, subjects, tracing
from shared.contracts.common import Codec, ContractError, ErrorCode, ErrorReply, encode
from shared.contracts.messages import Health, Heartbeat
from shared.natsconn import NatsAuth, connect_kwargs

log = logging.getLogger("pdmesh")

HEARTBEAT_INTERVAL_S = 1.0
CLOSE_GRACE_S = 5.0
VERSION = "0.1.0"


class ServiceError(Exception):
    """Raised by a handler to answer with a typed error (and a micro error header)."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None):
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message, request_id=request_id)


def new_instance_id(service: str) -> str:
    return subjects.instance_token(f"{service}_{socket.gethostname()}_{uuid.uuid4().hex[:6]}")


def setup_logging(service: str | None = None, level: str | None = None) -> None:
    """PDMESH_LOG (level) and PDMESH_LOG_FORMAT (text or json): shared/logs.py."""
    logs.setup(service, level)


_HTTP_CODE = {ErrorCode.BAD_MESSAGE: "400", ErrorCode.INVALID_REQUEST: "400",
              ErrorCode.TOKENIZER_MISMATCH: "409", ErrorCode.NOT_FOUND: "404",
              ErrorCode.OVERLOADED: "503", ErrorCode.SHUTTING_DOWN: "503"}


class ServiceRuntime:
    def __init__(self, service: str, instance_id: str, nats_url: str,
                 stats: Callable[[], dict[str, Any]] | None = None, description: str = "",
                 auth: NatsAuth | None = None):
        """nats_url: one server or several, comma-separated. auth: the service's NATS
        identity and TLS (its settings' `nats`); None: from PDMESH_NATS_* in the env."""
        self.service = service
        self.instance_id = instance_id
        logs.set_identity(service, instance_id)     # every JSON log line names them
        self.nats_url = nats_url
        self.auth = auth
        self.stats = stats or (lambda: {})
        self.description = description or f"pdmesh {service}"
        self.nc: nats.NATS | None = None
        self.micro = None
        self.stopping = asyncio.Event()
        self.bad_messages = 0
        self._tasks: list[asyncio.Task] = []
        self._handling: set[asyncio.Task] = set()   # concurrent endpoints' requests in hand

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.nats_url, name=f"{self.service}:{self.instance_id}",
                                auth=self.auth)
        tracing.instrument(self.nc)      # trace context in every message's headers (if on)
        self.micro = await add_service(
            self.nc, name=self.service, version=VERSION, description=self.description,
            metadata={"instance_id": self.instance_id},
            stats_handler=lambda _ep: self.stats() | {"bad_messages": self.bad_messages,
                                                      "nats_server": self.nats_server()})
        await self.endpoint("health", subjects.health(self.service, self.instance_id),
                            self._health, None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stopping.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass

    def nats_server(self) -> str:
        """host:port of the nats-server this instance is connected to now ("" if none)."""
        u = self.nc.connected_url if self.nc is not None and self.nc.is_connected else None
        return f"{u.hostname}:{u.port}" if u is not None else ""

    async def _health(self, _req) -> bytes:
        return encode(Health(service=self.service, instance_id=self.instance_id,
                             ok=not self.stopping.is_set()))

    async def run(self, heartbeat: Callable[[], Heartbeat] | None = None,
                  drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Publish heartbeats until a signal arrives, then drain (still heartbeating, so
        peers see a draining instance, not a dead one)."""
        beats = self.spawn(self._heartbeats(heartbeat)) if heartbeat is not None else None
        await self.stopping.wait()
        if drain is not None:
            await drain()
        if beats is not None:
            beats.cancel()

    async def _heartbeats(self, heartbeat: Callable[[], Heartbeat]) -> None:
        while True:
            if self.nc.is_connected:
                try:
                    await self.nc.publish(subjects.heartbeat(self.service), encode(heartbeat()))
                except Exception as e:  # noqa: BLE001 - reconnecting; try next beat
                    log.debug("heartbeat failed: %s", e)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.micro is not None:
            try:
                await self.micro.stop()
            except Exception:  # noqa: BLE001
                pass
        if self._handling:            # no new ones now: let those in hand answer
            await asyncio.wait(set(self._handling), timeout=CLOSE_GRACE_S)
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except Exception:  # noqa: BLE001
                await self.nc.close()

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.append(t)
        t.add_done_callback(_log_task_error)
        return t

    # ---- endpoints --------------------------------------------------------------------
    async def endpoint(self, name: str, subject: str,
                       handler: Callable[[Any], Awaitable[bytes | None]],
                       codec: Codec | None, raw: bool = False, queue_group: str | None = None,
                       concurrent: bool = False):
        """Register a micro endpoint. The handler gets the decoded struct (or the micro
        Request when raw=True) and returns reply bytes (or None for no reply). Bad
        messages and handler failures become typed error replies; the service lives on.

        A subscription hands its messages over one at a time: a handler that awaits I/O
        holds back every message behind it. concurrent=True runs each in a task of its
        own (those still running when the service closes get CLOSE_GRACE_S to answer)."""

        async def wrapped(req: Request) -> None:
            try:
                arg = req if raw else (codec.decode(req.data) if codec else req)
                reply = await handler(arg)
            except ContractError as e:
                self.bad_messages += 1
                log.warning("%s: %s on %s", self.service, e, req.subject)
                await _respond_error(req, ErrorReply(code=ErrorCode.BAD_MESSAGE, message=str(e)))
                return
            except ServiceError as e:
                await _respond_error(req, e.reply)
                return
            except Exception as e:  # noqa: BLE001 - never let a message kill the service
                log.exception("%s: handler %s failed", self.service, name)
                await _respond_error(req, ErrorReply(    # its type only: no repr, no path
                    code=ErrorCode.INTERNAL, message=f"internal error ({type(e).__name__})"))
                return
            if reply is not None and req._msg.reply:
                await req.respond(reply)

        traced = tracing.traced_handler(self.service, name, wrapped)
        if concurrent:
            async def each_in_a_task(req: Request) -> None:
                t = asyncio.ensure_future(traced(req))
                self._handling.add(t)
                t.add_done_callback(self._handling.discard)
                t.add_done_callback(_log_task_error)
            on_request = each_in_a_task
        else:
            on_request = traced
        await self.micro.add_endpoint(name=name, subject=subject, handler=on_request,
                                      queue_group=queue_group or "q")


async def _respond_error(req: Request, err: ErrorReply) -> None:
    if not req._msg.reply:
        return
    try:
        await req.respond_error(_HTTP_CODE.get(err.code, "500"), err.message, data=encode(err))
    except Exception:  # noqa: BLE001 - connection gone; nothing else to do
        pass


def _log_task_error(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("background task failed", exc_info=t.exception())


# A server that stops answering (its host partitioned: no RST, the socket just goes quiet)
# is left for another node of the cluster after PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1)
# = 3 s of unanswered PINGs: sooner than the 5 s after which the mesh takes a silent
# instance for dead (gateway decode_dead_after_s, decode gateway_dead_after_s). At nats-py's
# default (2 min x 2) a service on a cut-off node stayed stranded for minutes, and every
# request that needed it failed (scripts/netfaults_bench.py, cut_nats_node: 40 and 48 of 48).
PING_INTERVAL_S = 1.0
MAX_OUTSTANDING_PINGS = 2


async def connect(url: str, name: str, wait_s: float = 60.0,
                  auth: NatsAuth | None = None) -> nats.NATS:
    """Connect, retrying until a server is up (services start in any order), and keep
    reconnecting forever afterwards (a nats-server restart is survived). url: one server
    or a comma-separated list (a cluster: the client fails over to the others). auth:
    user/password and TLS CA (None: PDMESH_NATS_* from the environment)."""
    replies.install()        # answer inboxes only, whatever a requester names
    opts = connect_kwargs(url, auth if auth is not None else NatsAuth.from_env())
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await nats.connect(
                **opts, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                error_cb=_on_nats_error, disconnected_cb=_on_disconnect,
                reconnected_cb=_on_reconnect,
                connect_timeout=2, ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                pending_size=64 << 20, allow_reconnect=True)
        except Exception as e:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise
            log.info("waiting for nats at %s (%s)", url, e)
            await asyncio.sleep(0.5)


async def _on_nats_error(e: Exception) -> None:
    log.warning("nats: %s", e or type(e).__name__)


async def _on_disconnect() -> None:
    log.warning("nats: disconnected; reconnecting")


async def _on_reconnect() -> None:
    log.info("nats: reconnected")


def decode_reply(data: bytes, headers: dict | None, codec: Codec):
    """Decode a reply that may be a micro error (Nats-Service-Error headers)."""
    if headers and "Nats-Service-Error-Code" in headers:
        try:
            err = msgspec.json.decode(data, type=ErrorReply)
        except msgspec.DecodeError:
            err = ErrorReply(code=ErrorCode.INTERNAL, message=headers.get("Nats-Service-Error", ""))
        raise ServiceError(err.code, err.message, err.request_id)
    return codec.decode(data)
