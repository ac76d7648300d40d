"""Bad input gets a clear 4xx with an OpenAI-style body, over HTTP and over NATS, and the
mesh stays healthy."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import nats
import pytest

from shared import micro, subjects

BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("POST", "/v1/chat/completions", b"", 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target"}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": 5}]}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "temperature": 7}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 7}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "n": 99}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True}, 400),
    ("POST", "/v1/chat/completions", {"model": "tiny-target", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400),
    ("POST", "/v1/completions", {"model": "tiny-target", "prompt": ""}, 400),
    ("POST", "/v1/completions", {"model": "tiny-target", "prompt": [999999999]}, 400),
    ("POST", "/v1/completions", {"model": "tiny-target", "prompt": "x", "echo": True}, 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("POST", "/v1/nothing", {}, 404),
]


def test_malformed_http_inputs_get_4xx_and_mesh_stays_healthy(mesh):
    async def run():
        async with aiohttp.ClientSession() as http:
            for method, path, payload, status in BAD:
                data = payload if isinstance(payload, (bytes, type(None))) else json.dumps(payload).encode()
                async with http.request(method, mesh.url + path, data=data,
                                        headers={"content-type": "application/json"}) as r:
                    assert r.status == status, (path, payload, r.status, await r.text())
                    if path.startswith("/v1/") and status != 405:
                        err = (await r.json())["error"]
                        assert err["message"] and err["type"], err
            async with http.get(mesh.url + "/health") as r:
                assert r.status == 200
            async with http.post(mesh.url + "/v1/completions", json={
                    "model": "tiny-target", "prompt": "def f():", "max_tokens": 4}) as r:
                assert r.status == 200

    asyncio.run(run())


GARBAGE = [b"\x00\xff garbage", b"{}", b'{"v": 1, "request_id": 5}', b"[]", b'"str"',
           b'{"request_id": "x", "prompt_ids": "nope"}']


def test_garbage_on_every_service_subject_is_survived(mesh):
    async def run():
        instances = {}
        for name, proc in mesh.procs.items():
            if proc.instance_id:
                instances[name.rsplit("-", 1)[0]] = proc.instance_id
        # each garbage from the identity the mesh grants that subject (NATS auth is on, as
        # in pdmesh up): what a buggy or compromised peer can send
        targets = [("gateway", subjects.decode_submit(instances["decode"])),
                   ("gateway", subjects.decode_abort(instances["decode"])),
                   ("prefill", subjects.decode_kv(instances["decode"])),
                   ("prefill", subjects.decode_prefill_done(instances["decode"])),
                   ("decode", subjects.prefill_jobs()), (None, subjects.kvstore_health()),
                   ("decode", subjects.gateway_tokens(instances["gateway"])),
                   ("decode", subjects.heartbeat("decode")),
                   ("prefill", subjects.heartbeat("prefill"))]
        conns = {u: await nats.connect(**mesh.client_options(u), error_cb=_refused)
                 for u in {u for u, _ in targets}}
        for user, subj in targets:
            nc = conns[user]
            for g in GARBAGE:
                try:
                    r = await nc.request(subj, g, timeout=1.0, headers={"Pdmesh-seq": "x"})
                    if r.headers and "Nats-Service-Error-Code" in r.headers:
                        assert r.headers["Nats-Service-Error-Code"].startswith("4"), r.headers
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    pass  # fire-and-forget subjects have no reply
        for c in conns.values():
            await c.flush()               # every garbage is at the server before the
        nc = conns[None]                  # health questions
        for service, iid in instances.items():
            r = await nc.request(subjects.health(service, iid), b"", timeout=10)
            assert json.loads(r.data)["ok"], service
        for c in conns.values():
            await c.close()
        assert not refusals, refusals     # every garbage reached its service
        async with aiohttp.ClientSession() as http:
            async with http.post(mesh.url + "/v1/completions", json={
                    "model": "tiny-target", "prompt": "x = 1", "max_tokens": 4}) as r:
                assert r.status == 200

    asyncio.run(run())
    assert not mesh.unexpected_exits()


refusals: list[str] = []


async def _refused(e) -> None:
    if "ermission" in str(e):
        refusals.append(str(e))


def test_micro_discovery_finds_all_four_services(mesh):
    async def run():
        nc = await nats.connect(**mesh.client_options())    # debug, its own inbox prefix
        inbox = nc.new_inbox()
        names = []

        async def cb(msg):
            names.append(json.loads(msg.data)["name"])

        await nc.subscribe(inbox, cb=cb)
        await nc.publish("$SRV.PING", b"", reply=inbox)
        await until(lambda: set(names) >= FOUR)          # every one answered
        await nc.close()
        return names

    assert set(asyncio.run(run())) >= FOUR


FOUR = {"gateway", "decode", "prefill", "kvstore"}


async def until(cond, timeout_s: float = 20.0) -> None:
    """Wait for a state, not a time: cond() true, or fail after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("payload", [b"", b"x" * 10])
def test_pd_jobs_with_garbage_are_dropped(mesh, payload):
    """A malformed job on the JetStream queue is terminated, not redelivered forever."""
    async def run():
        debug = await nats.connect(**mesh.client_options())
        bad_before = await bad_jobs(debug)
        nc = await nats.connect(**mesh.client_options("decode"))    # who queues jobs
        js = nc.jetstream()
        await js.publish(subjects.prefill_jobs(), payload)
        deadline = asyncio.get_running_loop().time() + 30
        while True:      # until prefill has seen it (counted) and the stream is empty
            info = await js.stream_info(subjects.PREFILL_STREAM)
            seen = await bad_jobs(debug)
            if seen > bad_before and info.state.messages == 0:
                break
            assert asyncio.get_running_loop().time() < deadline, (seen, info.state)
            await asyncio.sleep(0.1)
        await nc.close()
        await debug.close()

    asyncio.run(run())


async def bad_jobs(nc) -> int:
    return int((await micro.total_stats(nc, "prefill", wait_s=0.3)).get("bad_jobs", 0))
