"""Stored Responses belong to the tenant (API key) that stored them: another key's GET,
DELETE and previous_response_id get the 404 of an id that does not exist, body for body.
`metadata` is bounded as OpenAI bounds it (16 pairs, keys of 64 characters, string values
of 512) and refused past that before anything is generated. Real gateway and nats-server,
one scripted decode instance that answers every request "hello"."""
from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from shared import subjects
from shared.contracts.common import Codec, encode
from shared.contracts.messages import DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk

pytestmark = pytest.mark.timeout(60)

RESP = "/v1/responses"
KEYS = ("sk-alpha-0123456789", "sk-beta-9876543210")
A, B = ({"Authorization": f"Bearer {k}"} for k in KEYS)


class ScriptedDecode:
    """Heartbeats, accepts every submit and answers it "hello" in one finished chunk."""

    def __init__(self, nc):
        self.nc, self.iid = nc, "d_0"
        self.subs: list[DecodeSubmit] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.decode_submit(self.iid), cb=self.on_submit)

    async def beat(self) -> None:
        await self.nc.publish(subjects.heartbeat("decode"), encode(Heartbeat(
            service="decode", instance_id=self.iid, blocks_free=1000, max_model_len=4096,
            ts=time.time())))

    async def on_submit(self, msg) -> None:
        sub = Codec(DecodeSubmit).decode(msg.data)
        self.subs.append(sub)
        await msg.respond(encode(SubmitAck(request_id=sub.request_id, path=Path.PD)))
        await self.nc.publish(sub.reply_subject, encode(TokenChunk(
            request_id=sub.request_id, token_ids=[5], text="hello", completion_tokens=1,
            finished=True, finish_reason="stop")))


@pytest.fixture
async def mesh(nats_url, spec, gateway_model_dir):
    """(http client, decode): a gateway with two API keys (two tenants) and one decode."""
    nc = await nats.connect(nats_url)
    decode = ScriptedDecode(nc)
    cfg = GatewayConfig(model=str(gateway_model_dir), nats_url=nats_url, request_timeout_s=20,
                        api_key=",".join(KEYS))
    async with TestClient(TestServer(create_app(cfg, spec))) as http:
        await decode.start()

        async def beats():
            while True:
                await decode.beat()
                await asyncio.sleep(0.2)
        task = asyncio.ensure_future(beats())
        registry = http.server.app[GATEWAY].registry
        deadline = time.monotonic() + 10
        while not registry.alive(time.monotonic()):
            assert time.monotonic() < deadline, "the gateway saw no decode heartbeat"
            await asyncio.sleep(0.05)
        try:
            yield http, decode
        finally:
            task.cancel()
            await nc.close()


async def ok(resp) -> dict:
    assert resp.status == 200, (await resp.text())[:500]
    return await resp.json()


async def not_found(resp) -> dict:
    """The whole 404 body: an OpenAI error."""
    assert resp.status == 404, (await resp.text())[:500]
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body


async def streamed_id(resp) -> str:
    assert resp.status == 200, (await resp.text())[:500]
    for block in (await resp.text()).split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                if data["type"] == "response.completed":
                    return data["response"]["id"]
    raise AssertionError("no response.completed event")


async def test_another_tenant_cannot_read_continue_or_delete_a_stored_response(mesh):
    http, decode = mesh
    first = await ok(await http.post(RESP, json={"input": "hi"}, headers=A))
    rid = first["id"]
    url, cont = f"{RESP}/{rid}", {"input": "again", "previous_response_id": rid}

    seen_by_b = [await not_found(await http.get(url, headers=B)),
                 await not_found(await http.delete(url, headers=B)),
                 await not_found(await http.post(RESP, json=cont, headers=B))]
    assert len(decode.subs) == 1                          # B's continuation never dispatched

    assert await ok(await http.get(url, headers=A)) == first   # B's DELETE deleted nothing
    again = await ok(await http.post(RESP, json=cont, headers=A))
    assert again["previous_response_id"] == rid
    assert len(decode.subs[-1].prompt_ids) > len(decode.subs[0].prompt_ids)  # A's turn first
    sid = await streamed_id(await http.post(RESP, json=cont | {"stream": True}, headers=A))
    await not_found(await http.get(f"{RESP}/{sid}", headers=B))
    await ok(await http.get(f"{RESP}/{sid}", headers=A))

    await ok(await http.delete(url, headers=A))
    gone = [await not_found(await http.get(url, headers=A)),
            await not_found(await http.delete(url, headers=A)),
            await not_found(await http.post(RESP, json=cont, headers=A))]
    assert seen_by_b == gone                  # to B it looked exactly like an unknown id


FULL = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}     # every bound reached


def one_off(key: str, value) -> dict:
    """FULL with its first pair swapped for this one: still 16 pairs."""
    return {key: value} | dict(list(FULL.items())[1:])


@pytest.mark.parametrize("metadata", [
    FULL | {"one-more": "v"},
    one_off("k" * 65, "v"),
    one_off("k", "v" * 513),
    one_off("k", 5),
], ids=["17-pairs", "65-char-key", "513-char-value", "non-string-value"])
async def test_metadata_past_openais_bounds_is_a_400_and_at_them_is_kept(mesh, metadata):
    http, decode = mesh
    r = await http.post(RESP, json={"input": "hi", "metadata": metadata}, headers=A)
    assert r.status == 400, (await r.text())[:500]
    error = (await r.json())["error"]
    assert error["param"] == "metadata" and error["type"] == "invalid_request_error"
    assert not decode.subs                                 # refused before any generation

    kept = await ok(await http.post(RESP, json={"input": "hi", "metadata": FULL}, headers=A))
    assert kept["metadata"] == FULL
    assert (await ok(await http.get(f"{RESP}/{kept['id']}", headers=A)))["metadata"] == FULL
