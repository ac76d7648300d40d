"""The gateway's end of tracing (shared/tracing.py): one SERVER span per HTTP request, the
root of the request's trace (or a child of the client's, from its `traceparent` header).
Every DecodeSubmit is sent inside a "gateway submit" span (dispatch.py), whose context
travels to decode in the NATS headers. Nothing at all when tracing is off.

A generation's root span carries OpenTelemetry's GenAI semantic conventions (as vLLM's
request span does): gen_ai.operation.name, gen_ai.request.model / max_tokens /
temperature / top_p / top_k / seed, gen_ai.response.id / model / finish_reasons,
gen_ai.usage.input_tokens / output_tokens, and the time to first token."""
from __future__ import annotations

from aiohttp import web

from shared import tracing

from .access import answers as noted

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/responses": "chat", "/v1/messages": "chat"}


def gen_ai(request: web.Request, route: str) -> dict:
    """The GenAI attributes of a generation's answer ({} for any other request)."""
    answers = noted(request)
    if not answers or route not in OPERATIONS:
        return {}
    a0, p = answers[0], answers[0].prep.params
    out = {"gen_ai.operation.name": OPERATIONS[route], "gen_ai.provider.name": "pdmesh",
           "gen_ai.request.model": a0.prep.options.model, "gen_ai.response.model":
           a0.prep.options.model, "gen_ai.response.id": a0.rid,
           "gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature":
           p.temperature, "gen_ai.request.top_p": p.top_p,
           "gen_ai.usage.input_tokens": a0.prompt_tokens,
           "gen_ai.usage.output_tokens": sum(a.reported or a.counted for a in answers),
           "gen_ai.response.finish_reasons": [a.finish_reason for a in answers
                                              if a.finish_reason]}
    if p.top_k:
        out["gen_ai.request.top_k"] = p.top_k
    if p.seed is not None:
        out["gen_ai.request.seed"] = p.seed
    if len(answers) > 1:
        out["gen_ai.request.choice.count"] = len(answers)
    if a0.ttft_s is not None:
        out["gen_ai.latency.time_to_first_token"] = a0.ttft_s      # vLLM's name
    return out


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
            s.set_attributes(gen_ai(request, route))
            return resp

    return [trace]
