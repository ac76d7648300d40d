"""Slow and idle clients hold nothing they do not use (issue 29), on the mesh as `pdmesh up`
runs it (API keys on; the gateway's own defaults but for shorter deadlines):

- 80 sockets that each send a header and one byte of body: another tenant is served at
  once, and each of them gets 408 once --body-timeout-s passes. Before, a request was in
  flight from its first byte and the 64 of them gave every other tenant 429.
- a streaming client that never reads: its slot is freed and decode told to abort within
  --write-timeout-s of the socket filling. Before, it held its slot as long as it stayed
  connected, long after decode had finished.
- one key cannot take every slot: past half the cap it gets 429 while another key is served.
Real nats-server, real services, real HTTP (raw sockets for the misbehaving clients)."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import aiohttp
import pytest

from pdmesh.local.cluster import Cluster

from .conftest import DET, det_overrides

pytestmark = pytest.mark.timeout(300)
KEYS = ("key-slow-tenant", "key-other-tenant")
IDLE = 80


def _overrides(**gateway) -> dict:
    # streams of thousands of tokens held by clients that never read: no loop may end one
    return det_overrides(monitor_repeat_window=0) | {
        "gateway": {"api_key": ",".join(KEYS)} | gateway}


async def _complete(http, url, key, **kw):
    t = time.monotonic()
    async with http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": "hello", "max_tokens": 4, **kw}) as r:
        return r.status, await r.json(), time.monotonic() - t


async def _in_flight(http, url) -> int:
    async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"}) as r:
        return int(float(re.search(r"^pdmesh_requests_in_flight (\S+)$", await r.text(),
                                   re.M).group(1)))


def _raw(port: int, head: bytes, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(head)
    return s


def _request(port: int, key: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
            ).encode() + body


@pytest.fixture(scope="module")
def mesh(tiny_target):
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, echo=False,
                 overrides=_overrides(body_timeout_s=3.0, write_timeout_s=2.0,
                                      max_in_flight=8)) as c:
        yield c


def test_idle_body_sockets_lock_nobody_out_and_time_out(mesh):
    port = int(mesh.url.rsplit(":", 1)[1])

    async def run():
        idle = [_raw(port, _request(port, KEYS[0], b"{", length=1000)) for _ in range(IDLE)]
        await asyncio.sleep(0.5)                      # every one has sent its byte
        async with aiohttp.ClientSession() as http:
            served = await _complete(http, mesh.url, KEYS[1])
            counted = await _in_flight(http, mesh.url)
        await asyncio.sleep(3.5)                      # past --body-timeout-s
        answers = []
        for s in idle:
            s.settimeout(5)
            answers.append(s.recv(200))
            s.close()
        return served, counted, answers
    (status, body, took), counted, answers = asyncio.run(run())
    assert status == 200, body                        # before: 429, 64 "in flight"
    assert took < 5.0, took
    assert counted == 0                               # an unread body is not in flight
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]


def test_a_client_that_never_reads_is_cut_off(mesh):
    port = int(mesh.url.rsplit(":", 1)[1])
    # 8 choices with 20 logprobs each: ~10 KB of events per step, so the server's socket
    # buffers (up to 4 MiB on loopback) fill within seconds
    body = json.dumps({"prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                       "stream": True, "logprobs": 20, "n": 8}).encode()

    async def run():
        s = _raw(port, _request(port, KEYS[0], body), rcvbuf=4096)   # and never reads
        async with aiohttp.ClientSession() as http:
            t, seen = time.monotonic(), []
            while time.monotonic() - t < 90:
                seen.append(await _in_flight(http, mesh.url))
                if seen[-1] == 0 and 1 in seen:
                    break
                await asyncio.sleep(0.25)
            async with http.get(mesh.url + "/metrics",
                                headers={"Authorization": f"Bearer {KEYS[1]}"}) as r:
                metrics = await r.text()
            after = await _complete(http, mesh.url, KEYS[1])
        s.close()
        return seen, metrics, after
    seen, metrics, (status, _, _) = asyncio.run(run())
    assert 1 in seen and seen[-1] == 0, seen          # before: held while connected
    assert re.search(r'pdmesh_request_failures_total\{code="client_gone"\} [1-9]', metrics), \
        [line for line in metrics.splitlines() if "failures" in line]
    assert status == 200


def test_one_key_cannot_take_every_slot(mesh):
    """max_in_flight 8: one key may hold 4. Four never-reading streams of the slow tenant
    (held until --write-timeout-s cuts them off), a fifth of its requests gets 429 naming
    the per-key limit, while the other tenant is served."""
    port = int(mesh.url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "hi", "max_tokens": 3000, "ignore_eos": True,
                       "stream": True}).encode()

    async def run():
        async with aiohttp.ClientSession() as http:
            held = [_raw(port, _request(port, KEYS[0], body), rcvbuf=4096) for _ in range(4)]
            t = time.monotonic()
            while await _in_flight(http, mesh.url) < 4 and time.monotonic() - t < 30:
                await asyncio.sleep(0.05)
            fifth = await _complete(http, mesh.url, KEYS[0])
            other = await _complete(http, mesh.url, KEYS[1])
        for s in held:
            s.close()
        return fifth, other
    (s5, b5, _), (so, bo, _) = asyncio.run(run())
    assert s5 == 429 and "per key" in b5["error"]["message"], b5
    assert so == 200, bo
