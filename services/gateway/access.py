"""The access log: one line per HTTP request once its answer ended (logger
`pdmesh.access`, on unless --no-access-log): method, path, status, latency, and for a
generation its request id, tokens in / out, time to first token, where it ran (pd or
colocated) and a digest of its tenant (never the key or the tenant's name). In JSON
(PDMESH_LOG_FORMAT=json, shared/logs.py) each is a field of its own.

    start(request)               before the handler: a box the answer's Answers go into
    note(request, answers)       the answer's Answers (respond / apis; choices: its list,
                                 filled as the choices are dispatched)
    log_access(request, status, seconds)

The box is made before the handler runs because a middleware below may hand the handler
a clone of the request (limits.body_middleware): a clone shares the box, not new keys.
"""
from __future__ import annotations

import hashlib
import logging

from aiohttp import web

from . import auth

log = logging.getLogger("pdmesh.access")
ANSWERS = web.RequestKey("pdmesh_answers", list)


def start(request: web.Request) -> None:
    request[ANSWERS] = []


def note(request: web.Request, answers: list) -> None:
    box = request.get(ANSWERS)
    if box is None:
        request[ANSWERS] = box = []
    box.append(answers)


def answers(request: web.Request) -> list:
    """Every answer noted for this request (one per choice), in order."""
    return [a for group in request.get(ANSWERS) or () for a in group]


def fields(request: web.Request, status: int, seconds: float) -> dict:
    out = {"method": request.method, "path": request.path, "status": status,
           "latency_ms": round(seconds * 1000, 1)}
    tenant = request.get(auth.TENANT, "")
    if tenant:
        out["tenant"] = hashlib.sha256(tenant.encode()).hexdigest()[:12]
    noted = answers(request)
    if noted:
        a0 = noted[0]
        out |= {"request_id": a0.rid, "prompt_tokens": a0.prompt_tokens,
                "completion_tokens": sum(a.reported or a.counted for a in noted),
                "placement": a0.d.path.value}
        if a0.ttft_s is not None:
            out["ttft_ms"] = round(a0.ttft_s * 1000, 1)
    return out


def log_access(request: web.Request, status: int, seconds: float) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    f = fields(request, status, seconds)
    text = " ".join(f"{k}={v}" for k, v in f.items() if k not in ("method", "path", "status"))
    log.info("%s %s %d %s", f["method"], f["path"], status, text, extra={"fields": f})
