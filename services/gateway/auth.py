"""Who may use the gateway (API keys), and whose prefix cache a request may touch (tenants).

Keys come from `--api-key` (repeatable, or comma-separated; env PDMESH_API_KEY) and
`--api-key-file` (one key per line; blank lines and `#` comments skipped). With no key
configured the gateway is OPEN: anyone who reaches its port may use it (it listens on
127.0.0.1 unless told otherwise); `pdmesh up` says which it is.

    protected   /v1/*, /tokenize, /detokenize, and /metrics (unless --open-metrics)
    open        /health, /ready: probes carry no credentials, and they reveal only
                liveness and counts

A client sends `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
(Anthropic's). Keys are compared as SHA-256 digests with hmac.compare_digest against
every configured key (no early exit), so the time taken says nothing about how much of a
key matched or which one. A missing or wrong key is a 401 in the route's error shape
(OpenAI's; Anthropic's on /v1/messages).

/metrics is keyed: it shows load, queue depths and cache counters of every tenant
together (an attacker timing cache hits would want them); Prometheus sends a bearer
token (`authorization: {credentials: KEY}`), or `--open-metrics` opens it for a scraper
on a private network.

Tenants: a request's prefix-cache salt (DecodeSubmit.cache_salt) is a digest of its key
(never the key: the salt travels on the bus), combined with the request's own
`cache_salt` field (vLLM's) when it sends one. Two keys never share a cached block, in any
tier, so one tenant can neither hit nor time another's prefix. `--shared-prefix-cache`
drops the key from the salt: every key shares (requests with the same `cache_salt` still
share only among themselves).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from aiohttp import web

from .protocol import OpenAIError

log = logging.getLogger("pdmesh.gateway")

TENANT = web.RequestKey("pdmesh_tenant", str)    # the key's tenant id ("" when open)
OPEN_PATHS = ("/health", "/ready")
PROTECTED_EXACT = ("/tokenize", "/detokenize")
MAX_CACHE_SALT = 256                              # chars of a request's own cache_salt


def parse_keys(api_key: str, api_key_file: str) -> list[str]:
    """The configured keys: comma-separated ones, then the file's lines. ValueError for a
    key file that cannot be read or holds no key, or a key with whitespace inside."""
    keys = [k.strip() for k in api_key.split(",") if k.strip()]
    if api_key_file:
        try:
            text = Path(api_key_file).read_text()
        except OSError as e:
            raise ValueError(f"api_key_file {api_key_file}: {e.strerror}") from None
        found = [ln.strip() for ln in text.splitlines()
                 if ln.strip() and not ln.strip().startswith("#")]
        if not found:
            raise ValueError(f"api_key_file {api_key_file} holds no key")
        keys += found
    for k in keys:
        if any(c.isspace() for c in k):
            raise ValueError("an API key must not contain whitespace")
    return list(dict.fromkeys(keys))


def _digest(key: str) -> bytes:
    # surrogateescape: a header's bytes that are not UTF-8 arrive as lone surrogates
    # (aiohttp decodes them so); they hash as those bytes and match no key, never a 500
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The configured keys as digests; `tenant(presented)` in constant time per key."""

    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def tenant(self, presented: str) -> str | None:
        """The tenant id of a valid key (a digest, safe to log and to send), else None."""
        d = _digest(presented)
        found = None
        for known in self._digests:       # every key compared: no early exit
            if hmac.compare_digest(d, known):
                found = known
        if found is None:
            return None
        return hashlib.blake2b(found, digest_size=16, person=b"pdmesh-tenant").hexdigest()


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get("x-api-key")
    return key.strip() if key is not None and key.strip() else None


def protected(path: str, open_metrics: bool) -> bool:
    if path.startswith("/v1/") or path == "/v1" or path in PROTECTED_EXACT:
        return True
    return path == "/metrics" and not open_metrics


def _denied(key: str | None) -> OpenAIError:
    hdr = {"WWW-Authenticate": 'Bearer realm="pdmesh"'}
    if key is None:
        return OpenAIError(401, "You didn't provide an API key. Send it in an Authorization "
                                "header using Bearer auth (Authorization: Bearer YOUR_KEY) or "
                                "in an x-api-key header.", type="invalid_request_error",
                           headers=hdr)
    shown = f"{key[:3]}***{key[-2:]}" if len(key) > 8 else "***"
    return OpenAIError(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key",
                       type="invalid_request_error", headers=hdr)


def middleware(ring: KeyRing, open_metrics: bool, on_denied=None):
    """aiohttp middleware: 401 on a protected path without a valid key; the request's
    tenant id under request[TENANT] ("" when no key is configured)."""

    @web.middleware
    async def check_key(request: web.Request, handler):
        if not ring.enabled:
            request[TENANT] = ""
            return await handler(request)
        key = presented_key(request)
        tenant = ring.tenant(key) if key is not None else None
        if tenant is None and protected(request.path, open_metrics):
            if on_denied is not None:
                on_denied()
            raise _denied(key)
        request[TENANT] = tenant or ""
        return await handler(request)

    return check_key


def cache_salt(tenant: str, requested: str | None, shared: bool) -> str:
    """The prefix-cache salt of a request: its tenant's (unless the cache is shared) and
    its own cache_salt, digested; "" when neither applies (the engine's unsalted keys)."""
    mine = "" if shared else tenant
    if not mine and not requested:
        return ""
    return hashlib.blake2b(f"{mine}\x1f{requested or ''}".encode(), digest_size=16,
                           person=b"pdmesh-salt").hexdigest()
