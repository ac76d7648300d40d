"""How a pdmesh process reaches NATS: the server list, its identity, TLS.

- `nats_url` may name several servers, comma-separated ("nats://a:4222,nats://b:4222"):
  the client fails over between them (a clustered NATS, `pdmesh up --nats-cluster 3`).
- `NatsAuth` is nested in every service's settings (flags --nats-user, --nats-password,
  --nats-password-file, --nats-tls-ca; env PDMESH_NATS_USER, ...). `pdmesh up` and compose
  give each service its own user (pdmesh/deploy/creds.py); the server grants that user exactly
  the subjects shared/subjects.py says the service uses.
- A service's reply inbox is `_INBOX.<user>.>` when it has a user, so its grant can name
  its own replies and nobody else's.

    nc = await nats.connect(**connect_kwargs(url, NatsAuth.from_env()), name="tool")
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from shared import pongs

INBOX = "_INBOX"


def servers(url: str | list[str]) -> list[str]:
    """"nats://a:1, nats://b:2" -> ["nats://a:1", "nats://b:2"]."""
    items = url if isinstance(url, list) else url.split(",")
    out = [u.strip() for u in items if u.strip()]
    if not out:
        raise ValueError(f"no NATS server in {url!r}")
    return out


def inbox_prefix(user: str) -> str:
    return f"{INBOX}.{user}" if user else INBOX


@dataclass
class NatsAuth:
    """Who a process is on NATS and how it checks the server (all optional)."""
    user: str = field(default="", metadata={"help": "NATS user name (pdmesh up: the service)"})
    password: str = field(default="", metadata={
        "help": "NATS password (prefer --nats-password-file: argv is visible to everyone)"})
    password_file: str = field(default="", metadata={
        "help": "file holding the NATS password (compose: a mounted secret)"})
    tls_ca: str = field(default="", metadata={
        "help": "CA certificate: connect over TLS and verify the servers against it"})

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "NatsAuth":
        """From PDMESH_NATS_USER, PDMESH_NATS_PASSWORD, ... (the flat setting names)."""
        env = os.environ if env is None else env
        return cls(**{f.name: env.get(f"PDMESH_NATS_{f.name.upper()}", "") for f in fields(cls)})

    def secret(self) -> str:
        if self.password or not self.password_file:
            return self.password
        with open(self.password_file) as f:
            return f.read().strip()

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls_ca:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def options(self) -> dict[str, Any]:
        """Keyword arguments for nats.connect (besides servers)."""
        opts: dict[str, Any] = {}
        if self.user:
            opts |= {"user": self.user, "password": self.secret(),
                     "inbox_prefix": inbox_prefix(self.user)}
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        return opts


def connect_kwargs(url: str | list[str], auth: NatsAuth | None = None) -> dict[str, Any]:
    """servers=[...] plus the identity and TLS options. With a CA, nats:// URLs become
    tls:// (the server requires TLS anyway; this makes the client insist on it too).
    A user given in the URL (nats://debug:pw@host) keeps the matching inbox prefix. Every
    pdmesh connection is made with these, so nats-py's PONG fix goes in here (pongs.py)."""
    pongs.install()
    auth = auth or NatsAuth()
    urls = servers(url)
    if auth.tls_ca:
        urls = ["tls://" + u.split("://", 1)[1] if u.startswith("nats://") else u for u in urls]
    opts = auth.options()
    if not auth.user:
        user = urlsplit(urls[0]).username
        if user:
            opts["inbox_prefix"] = inbox_prefix(user)
    return {"servers": urls} | opts
