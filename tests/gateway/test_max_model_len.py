"""--max-model-len and --chat-template at the gateway: the window /v1/models advertises and
requests are checked against; a chat that sets no max_tokens gets what fits (not the
512-token default cap and a 400); an explicit max_tokens that does not fit gets the 400.
Real gateway and nats-server, one scripted decode instance."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import GATEWAY, create_app
from services.gateway.config import GatewayConfig
from services.gateway.model import ModelSpec
from shared import subjects
from shared.contracts.common import Codec, encode
from shared.contracts.messages import DecodeSubmit, Heartbeat, Path, SubmitAck, TokenChunk

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi."}]
WINDOW = 64


@pytest.fixture(scope="module")
def small_spec(gateway_model_dir):
    return ModelSpec.load(GatewayConfig(model=str(gateway_model_dir), max_model_len=WINDOW))


def test_the_window_is_the_setting_but_never_past_the_model_s(gateway_model_dir, spec,
                                                              small_spec):
    assert small_spec.max_model_len == WINDOW < spec.max_model_len
    big = ModelSpec.load(GatewayConfig(model=str(gateway_model_dir),
                                       max_model_len=spec.max_model_len * 2),
                         tokenizer=spec.tokenizer)
    assert big.max_model_len == spec.max_model_len


def test_chat_template_file_replaces_the_model_s(gateway_model_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>")
    spec = ModelSpec.load(GatewayConfig(model=str(gateway_model_dir), chat_template=str(f)))
    assert spec.tokenizer.render_chat(MSGS) == "<user>Say hi.<bot>"
    with pytest.raises(ValueError, match="no such file"):
        GatewayConfig(model=str(gateway_model_dir), chat_template=str(tmp_path / "nope"))


@pytest.fixture
async def client(nats_url, small_spec, gateway_model_dir):
    """(http client, the DecodeSubmits decode got): one decode that answers every request
    with one token."""
    nc = await nats.connect(nats_url)
    got: list[DecodeSubmit] = []

    async def on_submit(msg) -> None:
        sub = Codec(DecodeSubmit).decode(msg.data)
        got.append(sub)
        await msg.respond(encode(SubmitAck(request_id=sub.request_id, path=Path.PD)))
        await nc.publish(sub.reply_subject, encode(TokenChunk(
            request_id=sub.request_id, token_ids=[5], text="hi", seq=0, completion_tokens=1,
            finished=True, finish_reason="stop")))

    await nc.subscribe(subjects.decode_submit("d_0"), cb=on_submit)
    beat = encode(Heartbeat(service="decode", instance_id="d_0", blocks_free=100,
                            max_model_len=WINDOW, ts=time.time()))
    cfg = GatewayConfig(model=str(gateway_model_dir), nats_url=nats_url, max_model_len=WINDOW,
                        request_timeout_s=20)
    async with TestClient(TestServer(create_app(cfg, small_spec))) as http:
        registry = http.server.app[GATEWAY].registry
        deadline = time.monotonic() + 10
        while not registry.alive(time.monotonic()):
            assert time.monotonic() < deadline, "the gateway saw no decode heartbeat"
            await nc.publish(subjects.heartbeat("decode"), beat)
            await asyncio.sleep(0.05)
        try:
            yield http, got
        finally:
            await nc.close()


async def test_models_advertise_the_window(client):
    http, _ = client
    (card,) = (await (await http.get("/v1/models")).json())["data"]
    assert card["max_model_len"] == WINDOW


async def test_chat_without_max_tokens_gets_what_fits_the_window(client, small_spec):
    http, got = client
    r = await http.post(CHAT, json={"messages": MSGS})
    assert r.status == 200, await r.text()
    assert (await r.json())["choices"][0]["message"]["content"] == "hi"
    prompt = len(small_spec.tokenizer.encode_chat(MSGS))
    assert got[0].params.max_tokens == WINDOW - prompt   # not the 512 default cap


async def test_explicit_max_tokens_past_the_window_is_a_400(client):
    http, got = client
    r = await http.post(CHAT, json={"messages": MSGS, "max_tokens": 100})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"maximum context length is {WINDOW} tokens" in err["message"] and not got
