"""The routes of apis/ on the gateway's aiohttp app, and the error shape per route.

    POST   /tokenize, /detokenize                 vLLM's shapes (tokenize.py)
    POST   /v1/responses                          OpenAI Responses API
    GET    /v1/responses/{id}, DELETE the same    a stored response (store.py), the
                                                  caller's tenant's only
    POST   /v1/messages                           Anthropic Messages API
    POST   /v1/messages/count_tokens              Anthropic's token count

Errors on /v1/messages* are Anthropic's {"type": "error", "error": {type, message}}; every
other route keeps OpenAI's {"error": {message, type, param, code}} (app._errors asks
`api_error_response` which).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web

from .. import protocol as P
from ..auth import TENANT
from ..protocol import OpenAIError
from . import messages_out, responses_out
from .common import Turn, run
from .messages import parse_messages
from .responses import parse_responses
from .store import ResponseStore
from .tokenize import detokenize, tokenize

if TYPE_CHECKING:
    from ..app import Gateway

ANTHROPIC_PREFIX = "/v1/messages"


def api_error_response(request: web.Request, e: OpenAIError) -> web.Response | None:
    """The error in the route's API shape; None: OpenAI's (the app's default)."""
    path = request.path
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return messages_out.error_response(e)
    return None


def add_routes(app: web.Application, gw: Gateway) -> ResponseStore:
    store = ResponseStore(gw.cfg.responses_store_size)

    async def on_tokenize(request: web.Request) -> web.Response:
        return _json(await gw.prepare(tokenize, await gw.read_body(request)))

    async def on_detokenize(request: web.Request) -> web.Response:
        return _json(await gw.prepare(detokenize, await gw.read_body(request)))

    async def answer_r(turn: Turn) -> web.StreamResponse:
        if turn.job.stream:
            return await responses_out.respond_stream(turn, store)
        return await responses_out.respond_whole(turn, store)

    async def on_responses(request: web.Request) -> web.StreamResponse:
        lookup = partial(store.history, tenant=_tenant(request))
        return await run(gw, request, partial(parse_responses, lookup=lookup), answer_r,
                         "resp")

    async def on_get_response(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        found = store.response(rid, _tenant(request))
        if found is None:
            raise _not_found(rid)
        return _json(found)

    async def on_delete_response(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if not store.delete(rid, _tenant(request)):
            raise _not_found(rid)
        return _json({"id": rid, "object": "response.deleted", "deleted": True})

    async def answer_m(turn: Turn) -> web.StreamResponse:
        if turn.job.stream:
            return await messages_out.respond_stream(turn)
        return await messages_out.respond_whole(turn)

    async def on_messages(request: web.Request) -> web.StreamResponse:
        return await run(gw, request, parse_messages, answer_m, "msg")

    async def on_count_tokens(request: web.Request) -> web.Response:
        job = await gw.prepare(_count_body, await gw.read_body(request))
        return _json({"input_tokens": len(job.prep.prompt_ids)})

    app.router.add_post("/tokenize", on_tokenize)
    app.router.add_post("/detokenize", on_detokenize)
    app.router.add_post("/v1/responses", on_responses)
    app.router.add_get("/v1/responses/{rid}", on_get_response)
    app.router.add_delete("/v1/responses/{rid}", on_delete_response)
    app.router.add_post(ANTHROPIC_PREFIX, on_messages)
    app.router.add_post(ANTHROPIC_PREFIX + "/count_tokens", on_count_tokens)
    return store


def _count_body(body: bytes, spec):
    """count_tokens takes a Messages body without max_tokens."""
    import json
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and "max_tokens" not in data:
        data["max_tokens"] = 1
        body = json.dumps(data).encode()
    return parse_messages(body, spec)


def _tenant(request: web.Request) -> str:
    """Whose stored responses the request sees (store.py); "" on an open gateway."""
    return request.get(TENANT, "")


def _json(obj: dict) -> web.Response:
    return web.Response(body=P.dumps(obj), content_type="application/json")


def _not_found(rid: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{rid}' not found (responses are kept with "
                            f"store: true, in a bounded in-memory store)", "response_id",
                       code="not_found")
