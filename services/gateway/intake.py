"""Every generation endpoint's way in (chat, completions, Responses, Messages): read the
body (408 past --body-timeout-s), parse and validate it off the event loop (gw.prepare:
the API's parser gives a `Prepared`, or the API's Job around one), admit it (503 while
draining, 429 past the caps, overall and per key), name it, and hand it to the API's
answer; it leaves the in-flight count however the answer ends.

    await generate(gw, request, parse, "chatcmpl-", answer)  # answer(job, rid, arrival)
    d = await submit(gw, request, prep, rid)                 # one dispatch, counted
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import auth
from .dispatch import Dispatch
from .validate import Prepared

if TYPE_CHECKING:
    from .app import Gateway


async def generate(gw: Gateway, request: web.Request, parse: Callable[[bytes, Any], Any],
                   id_prefix: str,
                   answer: Callable[[Any, str, float], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    arrival = time.monotonic()
    job = await gw.prepare(parse, await gw.read_body(request))
    key = request.get(auth.TENANT, "")
    gw.admit(key)              # in flight from here: the body is in and parsed
    try:
        return await answer(job, f"{id_prefix}{uuid.uuid4().hex}", arrival)
    finally:
        gw.done(key)


async def submit(gw: Gateway, request: web.Request, prep: Prepared, rid: str,
                 prefer: str | None = None, params=None) -> Dispatch:
    """Dispatch one request (or one choice: its own params) to a decode instance."""
    d = await gw.client.submit(rid, prep.prompt_ids, params or prep.params, prep.constraint,
                               prep.options.force_path, gw.cache_salt(request, prep),
                               prefer=prefer)
    gw.metrics.placements.inc(placement=d.path.value)
    return d
