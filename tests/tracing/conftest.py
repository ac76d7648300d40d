"""Tracing fixtures: a real nats-server (the gateway tests' fixture)."""
from tests.gateway.conftest import nats_url  # noqa: F401
