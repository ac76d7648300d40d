"""Migration (invariant 7): a request whose decode instance was lost (dead, silent, or a
chunk went missing: dispatch.Lost) continues on another instance as prompt + the tokens
received so far. `resume_from` tells decode (and prefill) that the last n prompt tokens are
output already: both engines' grammars replay them, and the sampler's stream is keyed by
position, so a seeded stream goes on as one generation. max_tokens / min_tokens shrink by
what was received. A dead instance is never tried again; one that only lost chunks may take
the request back when no other can. At most max_migrations moves per request."""
from __future__ import annotations

import logging

import msgspec

from .dispatch import DecodeClient, Dispatch, Submission
from .protocol import OpenAIError

log = logging.getLogger("pdmesh.gateway")


async def migrate(client: DecodeClient, d: Dispatch, output_ids: list[int],
                  reason: str) -> Dispatch | None:
    """d's instance was lost: continue the request elsewhere from output_ids (the
    tokens received so far). None once max_migrations moves were made, or when no
    instance takes it; the caller then reports the loss."""
    if d.migrations >= client.max_migrations:
        return None
    origin = d.origin or d.sub
    n = len(output_ids)
    p = origin.params
    if n >= p.max_tokens:
        return None
    params = msgspec.structs.replace(p, max_tokens=p.max_tokens - n,
                                     min_tokens=max(0, p.min_tokens - n))
    sub = Submission(f"{origin.request_id}.m{d.migrations + 1}",   # a fresh id
                     origin.prompt_ids + list(output_ids), params, origin.constraint,
                     origin.force_path, resume_from=n, cache_salt=origin.cache_salt,
                     tried={d.instance})
    await client.abort(d, f"migrated_{reason}")     # if it still lives, it stops
    client.release(d)
    # an instance that only lost chunks (not dead) may take the request back when no
    # other instance can
    for tried in ([sub.tried] if reason == "instance_dead" else [sub.tried, set()]):
        sub.tried = tried
        try:
            nd = await client.send(sub)
            break
        except OpenAIError as e:
            error = e
    else:
        log.warning("%s: migration failed: %s", origin.request_id, error.message)
        return None
    nd.redispatches, nd.migrations, nd.origin = d.redispatches, d.migrations + 1, origin
    return nd
