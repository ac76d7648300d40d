"""The gateway's HTTP face (aiohttp) and its wiring to NATS.

    app = create_app(cfg)            # on startup: NATS, micro registration, subscriptions
    POST /v1/chat/completions        validate -> dispatch -> JSON or SSE
    POST /v1/completions
    GET  /v1/models, /v1/models/{model}, /health, /metrics

Every error a client or a peer causes is an OpenAI error body with a 4xx/5xx status that
says what went wrong; a 500 means a bug in this gateway.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from aiohttp import web

from shared.contracts.common import ErrorCode
from shared.contracts.messages import Heartbeat
from shared.service import ServiceRuntime

from . import access, auth, intake, limits, protocol as P, trace
from .apis.routes import add_routes, api_error_response
from .choices import answer_n
from .chunks import ClientGone
from .config import GatewayConfig
from .dispatch import DecodeClient
from .grammar_check import GrammarGuard, deferred
from .handover import Handover
from .metrics import CONTENT_TYPE, Metrics
from .model import ModelSpec
from .protocol import OpenAIError
from .registry import Registry
from .respond import answer
from .scrape import MeshStats
from .slowclients import WRITE_TIMEOUT, Slots, key_cap, read_body
from .validate import Prepared, parse_chat, parse_completion

log = logging.getLogger("pdmesh.gateway")


class Gateway:
    """State shared by the handlers, and its start / drain / close."""

    def __init__(self, cfg: GatewayConfig, spec: ModelSpec):
        self.cfg, self.spec = cfg, spec
        self.registry = Registry(cfg.decode_dead_after_s, spec.tokenizer.fingerprint)
        self.metrics = Metrics(spec.name)
        self.runtime = ServiceRuntime("gateway", cfg.instance_id, cfg.nats_url, stats=self.stats,
                                      description="pdmesh gateway: OpenAI-compatible REST",
                                      auth=cfg.nats)
        self.client: DecodeClient | None = None
        self.slots = Slots()           # requests in flight, in all and per API key
        self.draining = False
        self.handover = Handover()     # the port to a successor (pdmesh restart gateway)
        self._drained = asyncio.Event()
        # one thread: template rendering and tokenizing stay off the event loop, and HF fast
        # tokenizers are not safe to call from several threads at once
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenize")
        self.token_text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(
            lambda t: spec.tokenizer.decode([t]))
        self.keys = auth.KeyRing(auth.parse_keys(cfg.api_key, cfg.api_key_file))
        self.grammar = GrammarGuard(spec.folder or cfg.model, spec.vocab_size,
                                    cfg.grammar_timeout_s)
        self.body_limit = cfg.max_body_bytes     # and at most NATS max_payload, once connected
        self.mesh_stats = MeshStats(
            lambda: self.runtime.nc, cfg.metrics_refresh_s, self.metrics.vllm.model_name,
            decode_count=lambda: len(self.registry.alive(time.monotonic())) or None)

    async def start(self) -> None:
        await self.runtime.start()
        self.client = DecodeClient(self.runtime.nc, self.registry, self.cfg.instance_id,
                                   self.spec.tokenizer.fingerprint, self.cfg.submit_timeout_s,
                                   self.cfg.request_timeout_s,
                                   max_redispatch=self.cfg.max_redispatch,
                                   max_migrations=self.cfg.max_migrations,
                                   progress_timeout_s=self.cfg.progress_timeout_s,
                                   first_chunk_timeout_s=self.cfg.first_chunk_timeout_s)
        await self.client.start()
        self.body_limit = limits.body_limit(self.cfg.max_body_bytes, self.runtime.nc.max_payload)
        self.runtime.spawn(self.grammar.warm())
        self.runtime.spawn(self.mesh_stats.run())   # /metrics' view of the other services
        # heartbeats go on while it drains: decode would take a silent gateway for gone and
        # abort its requests (orphans) before they finished
        self.runtime.spawn(self.runtime.run(heartbeat=self._heartbeat, drain=self._drained.wait))
        if self.keys.enabled:
            log.info("API keys: %d configured; /v1/* needs one", len(self.keys))
        else:
            log.warning("NO API KEY configured: this gateway serves anyone who reaches it")
        log.info("gateway %s serving %s (context %d) via %s", self.cfg.instance_id,
                 self.spec.name, self.spec.max_model_len, self.cfg.nats_url)

    async def drain(self, refuse_new: bool = True) -> None:
        """Refuse new requests, let in-flight ones finish for drain_grace_s, then end the
        rest with an explicit error. refuse_new False: a successor has the port, and what
        still arrives on a connection opened before is served (handover.py)."""
        try:
            await self._drain(refuse_new)
        finally:
            self._drained.set()

    async def _drain(self, refuse_new: bool) -> None:
        self.draining = refuse_new
        deadline = time.monotonic() + self.cfg.drain_grace_s
        if self.handover.on:
            await self.handover.settle(deadline)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight and self.client is not None:
            n = self.client.fail_all(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down")
            log.warning("drain: ending %d request(s) still in flight", n)
            end = time.monotonic() + 2.0
            while self.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.runtime.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self.grammar.close()

    async def prepare(self, parse: Callable[[bytes, ModelSpec], Prepared], body: bytes) -> Prepared:
        """parse(body, spec) on the tokenizer thread; its grammars are then compiled with a
        time limit on grammar_check's threads (the tokenizer thread never waits on one)."""
        out, pending = await asyncio.get_running_loop().run_in_executor(
            self._cpu, deferred, parse, body, self.spec)
        if pending:
            await self.grammar.check(pending)
        return out

    def cache_salt(self, request: web.Request, prep: Prepared) -> str:
        """The request's prefix-cache salt: its API key's tenant and its own cache_salt."""
        return auth.cache_salt(request.get(auth.TENANT, ""), prep.options.cache_salt,
                               self.cfg.shared_prefix_cache)

    @property
    def in_flight(self) -> int:
        return self.slots.total

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise OpenAIError(503, "the gateway is shutting down", code="shutting_down")

    async def read_body(self, request: web.Request) -> bytes:
        """The body within --body-timeout-s (408 after); a request is not in flight yet."""
        self.refuse_if_draining()
        return await read_body(request, self.cfg.body_timeout_s)

    def admit(self, key: str) -> None:
        """Count a request whose body was read and parsed as in flight for its API key,
        or raise: 503 while draining, 429 (with Retry-After) past max_in_flight or past
        the per-key cap. Every generating endpoint calls it, then done(key) when over."""
        self.refuse_if_draining()
        cap = self.cfg.max_in_flight or 4 * self.registry.capacity(time.monotonic())
        try:
            self.slots.take(key, cap, key_cap(cap, self.cfg.max_in_flight_per_key))
        except OpenAIError:
            self.metrics.failures.inc(code="rate_limit_exceeded")
            raise

    def done(self, key: str) -> None:
        self.slots.give(key)

    def nats_connected(self) -> bool:
        nc = self.runtime.nc
        return nc is not None and nc.is_connected

    def stats(self) -> dict:
        return {"in_flight": self.in_flight, "requests": int(self.metrics.requests.total()),
                "failures": int(self.metrics.failures.total()),
                "decode_instances": len(self.registry.alive(time.monotonic())),
                "draining": self.draining, "auth": self.keys.enabled,
                "queues": len(self.client.queues) if self.client is not None else 0,
                **({"chunks_dropped": self.client.chunks.dropped_chunks,
                    "chunks_malformed": self.client.chunks.bad_messages,
                    "heartbeats_malformed": self.client.bad_messages}
                   if self.client is not None else {}),
                "invalid_heartbeats": self.registry.invalid,
                **{f"grammar_{k}": n for k, n in self.grammar.counts.items()}}

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(service="gateway", instance_id=self.cfg.instance_id, model=self.spec.name,
                         tokenizer_fingerprint=self.spec.tokenizer.fingerprint,
                         running=self.in_flight, ts=time.time())


GATEWAY = web.AppKey("gateway", Gateway)


def create_app(cfg: GatewayConfig, spec: ModelSpec | None = None) -> web.Application:
    """The aiohttp application; NATS is connected on startup and drained on cleanup.
    `spec` defaults to ModelSpec.load(cfg) (tokenizer + config.json of cfg.model)."""
    gw = Gateway(cfg, spec or ModelSpec.load(cfg))
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[
        gw.handover.middleware, *trace.middlewares(), _errors,
        auth.middleware(gw.keys, cfg.open_metrics), limits.body_middleware(lambda: gw.body_limit)])
    app[GATEWAY] = gw
    app[WRITE_TIMEOUT] = cfg.write_timeout_s
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    add_routes(app, gw)      # /v1/responses, /v1/messages, /tokenize, /detokenize (apis/)

    async def start(_app):
        await gw.start()

    async def close(_app):
        await gw.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.on_response_prepare.append(gw.handover.on_prepare)
    return app


# ---- generation ------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, parse_chat, "chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, parse_completion, "cmpl-")


async def _openai(request: web.Request, parse, id_prefix: str) -> web.StreamResponse:
    gw = request.app[GATEWAY]

    async def respond(prep: Prepared, rid: str, arrival: float) -> web.StreamResponse:
        if prep.options.n > 1:
            return await answer_n(request, gw, prep, rid, arrival)
        d = await intake.submit(gw, request, prep, rid)
        return await answer(request, gw.client, d, prep, rid, arrival, gw.metrics, gw.token_text)
    return await intake.generate(gw, request, parse, id_prefix, respond)


# ---- the rest --------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    s = request.app[GATEWAY].spec
    # root: the served name, never the model's folder (no filesystem path in a response)
    return web.json_response(P.model_list(s.name, s.created, s.max_model_len, s.name))


async def model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    name = request.match_info["model"]
    if name != gw.spec.name:
        raise OpenAIError(404, f"The model `{name}` does not exist; this server serves "
                               f"`{gw.spec.name}`.", "model", code="model_not_found")
    s = gw.spec
    return web.json_response(P.model_card(s.name, s.created, s.max_model_len, s.name))


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    alive = len(gw.registry.alive(time.monotonic()))
    connected = gw.nats_connected()
    reasons = [r for r, bad in (("draining", gw.draining), ("not connected to NATS", not connected),
                                ("no decode instance alive", not alive)) if bad]
    body = {"status": "unavailable" if reasons else "ok", "decode_instances": alive,
            "nats_connected": connected, "draining": gw.draining, "in_flight": gw.in_flight}
    if reasons:
        body["reason"] = "; ".join(reasons)
    return web.json_response(body, status=503 if reasons else 200)


async def ready(request: web.Request) -> web.Response:
    """Readiness (distinct from /health, liveness): every path is usable now. 200 once
    NATS is connected and every live decode instance reports itself ready (a prefill
    worker heard from, when the mesh has some); `pdmesh up` waits for it."""
    gw = request.app[GATEWAY]
    alive = [i for i in gw.registry.alive(time.monotonic()) if i.hb.accepting]
    not_ready = sorted(i.hb.instance_id for i in alive if not i.hb.ready)
    reasons = [r for r, bad in (("draining", gw.draining),
                                ("not connected to NATS", not gw.nats_connected()),
                                ("no decode instance alive", not alive),
                                (f"decode not ready (no prefill worker heard): "
                                 f"{', '.join(not_ready)}", not_ready)) if bad]
    body = {"status": "not_ready" if reasons else "ready", "decode_instances": len(alive)}
    if reasons:
        body["reason"] = "; ".join(reasons)
    return web.json_response(body, status=503 if reasons else 200)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    t = gw.registry.totals(time.monotonic())
    text = gw.metrics.render(gw.mesh_stats.series | gw.metrics.vllm.gauges(
        t["running"], t["waiting"], t["blocks_used"], t["blocks_free"]) | {
        "pdmesh_routed_prefix_warm_total": ("Requests routed to the decode instance that "
                                            "last served their prefix.", gw.client.routed_warm),
        "pdmesh_requests_in_flight": ("Requests this gateway is serving.", gw.in_flight),
        "pdmesh_decode_instances_alive": ("Decode instances heartbeating.", t["instances"]),
        "pdmesh_prefill_queue_depth": ("Prefill jobs queued, summed over decode heartbeats.",
                                       t["queue_depth"]),
        "pdmesh_decode_running": ("Running requests, summed over decode heartbeats.", t["running"]),
        "pdmesh_decode_waiting": ("Waiting requests, summed over decode heartbeats.", t["waiting"]),
        "pdmesh_kv_blocks_used": ("KV blocks in use, summed over decode heartbeats.",
                                  t["blocks_used"]),
        "pdmesh_kv_blocks_free": ("KV blocks free, summed over decode heartbeats.",
                                  t["blocks_free"]),
        "pdmesh_kv_blocks_quarantined": ("KV blocks of aborted requests awaiting reclaim "
                                         "(never handed out), summed over decode heartbeats.",
                                         t["blocks_quarantined"]),
    })
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


# ---- errors ----------------------------------------------------------------------------


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


def _error_response(request: web.Request, e: OpenAIError) -> web.Response:
    resp = api_error_response(request, e)       # e.g. Anthropic's shape on /v1/messages
    if resp is None:
        resp = web.Response(status=e.status, body=P.dumps(e.body()),
                            content_type="application/json", headers=e.headers)
    if e.headers.get("Connection") == "close":
        resp.force_close()          # a body not read to its end: the connection is not reused
    return resp


def _http_error(e: web.HTTPException, request: web.Request) -> OpenAIError:
    if e.status == 404:
        return OpenAIError(404, f"no route {request.method} {request.path}", code="not_found")
    if e.status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        return OpenAIError(405, f"method {request.method} is not allowed on {request.path}"
                                f"{f' (allowed: {allowed})' if allowed else ''}",
                           code="method_not_allowed")
    if e.status == 413:
        return limits.too_large(request.app[GATEWAY].body_limit)
    return OpenAIError(e.status, e.reason or str(e))


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    counter = gw.metrics.requests
    route = _route(request)
    t0 = time.monotonic()
    access.start(request)
    try:
        resp = await handler(request)
    except OpenAIError as e:
        resp = _error_response(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _error_response(request, _http_error(e, request))
    except (ClientGone, ConnectionError):
        # the client left (a ConnectionError: while its headers were being written);
        # nobody reads this, and answering keeps aiohttp from logging a traceback
        resp = _error_response(request, OpenAIError(499, "client closed the connection",
                                                    code="client_gone"))
    except asyncio.CancelledError:
        counter.inc(path=route, status="499")
        if gw.cfg.access_log:
            access.log_access(request, 499, time.monotonic() - t0)
        raise
    except Exception:  # noqa: BLE001 - a bug here; the client still gets a JSON error
        ref = uuid.uuid4().hex[:12]     # the log has the traceback; the client, a reference
        log.exception("unhandled error on %s %s (reference %s)", request.method, request.path,
                      ref)
        resp = _error_response(request, OpenAIError(500, f"internal error in the gateway "
                                                         f"(reference {ref})", code="internal"))
    counter.inc(path=route, status=str(resp.status))
    if gw.cfg.access_log:
        access.log_access(request, resp.status, time.monotonic() - t0)
    return resp
