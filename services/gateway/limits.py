"""Bounds on what one request may ask of the mesh, checked before anything is built or
cached (validate.py, structured.py), and the one bound the bus sets: a DecodeSubmit must
fit in one NATS message (`check_fits`).

    body            min(--max-body-bytes, the NATS connection's max_payload): a body
                    over it is refused (413) from its Content-Length, before it is read
    submission      the encoded DecodeSubmit <= max_payload - SUBMIT_HEADROOM, else 413
    tools           MAX_TOOLS tools, MAX_TOOLS_CHARS of canonical JSON together
    schema          MAX_SCHEMA_CHARS of canonical JSON (build.py's limit), nesting depth
                    structured.MAX_SCHEMA_DEPTH; compiling it for constrained decoding
                    must finish within --grammar-timeout-s (grammar_check.py)
    stop            MAX_STOP strings of at most MAX_STOP_CHARS characters
    stop_token_ids  MAX_STOP_TOKEN_IDS ids
    logit_bias      MAX_LOGIT_BIAS entries (OpenAI's limit)
    cache_salt      MAX_CACHE_SALT characters
Sampling ranges that keep the logits finite live with the params (SamplingParams.check).
"""
from __future__ import annotations

from .protocol import OpenAIError

SUBMIT_HEADROOM = 4096      # a message's headers and protocol line ride in max_payload too
MAX_TOOLS = 128             # OpenAI's limit
MAX_TOOLS_CHARS = 512 * 1024
MAX_SCHEMA_CHARS = 256 * 1024
MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_CACHE_SALT = 256


def check_fits(size: int, max_payload: int) -> None:
    """413 for a submission larger than one NATS message may be (the connection's
    max_payload, less room for headers): no instance could take it, and sending it would
    fail as a misleading 503."""
    limit = max_payload - SUBMIT_HEADROOM
    if max_payload and size > limit:
        raise OpenAIError(413, f"request too large: its prompt and constraint come to "
                               f"{size} bytes on the bus, over the {limit} a message may hold "
                               f"(NATS max_payload); shorten the prompt, tools or schema",
                          code="request_too_large")


def body_limit(max_body_bytes: int, max_payload: int) -> int:
    """The gateway's body limit: its own, and never more than one NATS message."""
    return min(max_body_bytes, max_payload) if max_payload else max_body_bytes


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than {limit} bytes (the gateway's limit: "
                            f"--max-body-bytes, at most the NATS max_payload)",
                       code="request_too_large")


def check_stop(stop, stop_token_ids) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP:
        raise OpenAIError(400, f"'stop' may hold at most {MAX_STOP} sequences, got {len(stops)}",
                          "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise OpenAIError(400, f"'stop' sequences may be at most {MAX_STOP_CHARS} "
                                   f"characters, got one of {len(s)}", "stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise OpenAIError(400, f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                               f"got {len(stop_token_ids)}", "stop_token_ids")


def check_logit_bias(bias) -> None:
    if bias is not None and len(bias) > MAX_LOGIT_BIAS:
        raise OpenAIError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got "
                               f"{len(bias)}", "logit_bias")


def check_cache_salt(salt) -> None:
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise OpenAIError(400, f"'cache_salt' must be 1 to {MAX_CACHE_SALT} characters",
                          "cache_salt")


def body_middleware(limit_of):
    """aiohttp middleware: a body whose Content-Length is over limit_of() is refused (413)
    before a byte of it is read; a chunked one is cut off at the limit while read."""
    from aiohttp import web

    @web.middleware
    async def limit_body(request: web.Request, handler):
        limit = limit_of()
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        if request.can_read_body:
            request = request.clone(client_max_size=limit)
        return await handler(request)

    return limit_body
