"""Stored Responses (`store: true`, the default): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

A bounded in-memory LRU per gateway process: at most `max_entries` responses (the gateway's
`--responses-store-size`, 1024 by default); the least recently used (stored or read) goes
first; nothing survives a restart, and a response stored by one gateway is unknown to
another (a continuation routed elsewhere gets 404 previous_response_not_found). An entry
holds the response body and its conversation as chat messages (every turn so far without
the instructions, then this response's own output as the assistant turn).

Tenants: an entry is kept under (tenant, id), the tenant of the request that stored it
(auth.TENANT: its API key's; "" on an open gateway, where everyone is that one tenant).
Another tenant's lookup, read, continuation or delete misses exactly as an unknown id
does, so a 404 never says that the id exists. The LRU bound is shared by all tenants.

Thread-safe: lookups run in the gateway's tokenizer thread (inside the request's parse),
puts on the event loop.
"""
from __future__ import annotations

import threading
from collections import OrderedDict


class ResponseStore:
    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[dict, list]] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict, history: list, tenant: str = "") -> None:
        if self.max_entries <= 0:
            return
        key = (tenant, rid)
        with self._lock:
            self._entries[key] = (response, history)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def _get(self, rid: str, tenant: str) -> tuple[dict, list] | None:
        key = (tenant, rid)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def history(self, rid: str, tenant: str = "") -> list | None:
        entry = self._get(rid, tenant)
        return entry[1] if entry is not None else None

    def response(self, rid: str, tenant: str = "") -> dict | None:
        entry = self._get(rid, tenant)
        return entry[0] if entry is not None else None

    def delete(self, rid: str, tenant: str = "") -> bool:
        with self._lock:
            return self._entries.pop((tenant, rid), None) is not None
