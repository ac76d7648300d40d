"""The gateway's end of tracing (shared/tracing.py): one SERVER span per HTTP request, the
root of the request's trace (or a child of the client's, from its `traceparent` header).
Every DecodeSubmit is sent inside a "gateway submit" span (dispatch.py), whose context
travels to decode in the NATS headers. Nothing at all when tracing is off."""
from __future__ import annotations

from aiohttp import web

from shared import tracing


def middlewares() -> list:
    """[the tracing middleware] when tracing is on, else []."""
    if not tracing.ON:
        return []

    @web.middleware
    async def trace(request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        with tracing.root("gateway", f"{request.method} {route}", request.headers) as s:
            s.set_attribute("http.request.method", request.method)
            s.set_attribute("http.route", route)
            resp = await handler(request)
            s.set_attribute("http.response.status_code", resp.status)
            return resp

    return [trace]
