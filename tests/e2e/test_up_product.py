"""`pdmesh up` as vLLM's users launch it (issue 28): vLLM's everyday flags behave as vLLM's do,
and the supervisor gives up on a crash loop, saying which child and why. A real `pdmesh up`
subprocess, found through its run record; the tiny model, auth on (the default)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdmesh.local.launched import UpMesh
from tests.conftest import TINY_TARGET

KEY = "k-" + "x" * 30


@pytest.fixture(scope="module")
def up():
    loop = asyncio.new_event_loop()
    m = UpMesh("--model", str(TINY_TARGET), "--prefill", "0", "--api-key", KEY,
               "--max-model-len", "512", "--served-model-name", "tiny", "--restart-limit", "2")
    try:
        loop.run_until_complete(m.start())
        yield m, loop
    finally:
        loop.run_until_complete(m.stop())
        loop.close()


def run(up, coro):
    return up[1].run_until_complete(asyncio.wait_for(coro, 300))


async def _get(url: str, key: str | None = None, body: dict | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        if body is None:
            async with http.get(url, headers=headers) as r:
                return r.status, await r.json()
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, await r.json()


def test_api_key_served_model_name_and_max_model_len_as_vllm(up):
    m, _ = up
    status, body = run(up, _get(m.url + "/v1/models"))
    assert status == 401 and "error" in body
    status, body = run(up, _get(m.url + "/v1/models", KEY))
    assert status == 200
    assert [(c["id"], c["max_model_len"]) for c in body["data"]] == [("tiny", 512)]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "def fib(n):"}]}
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat))   # no max_tokens
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 512
    status, body = run(up, _get(m.url + "/v1/chat/completions", KEY, chat | {"max_tokens": 600}))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_a_crash_loop_stops_the_mesh_naming_the_child(up):
    m, _ = up
    old = m.sigkill("kvstore-0")
    run(up, m.back("kvstore-0", old))              # the first exit: started again
    m.sigkill("kvstore-0")                         # the second within the window: a loop
    deadline = time.monotonic() + 60
    while m.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert m.proc.returncode == 1, m.tail(30)
    out = m.tail(200)
    assert "kvstore-0 exited 2 times within 60 s (crash loop" in out
    assert "pdmesh: stopped" in out
