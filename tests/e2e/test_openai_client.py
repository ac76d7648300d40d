"""The official openai client against the mesh: chat and completions, stream and not,
usage that adds up."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-target"]


def test_chat_non_stream(client):
    r = client.chat.completions.create(
        model="tiny-target", messages=[{"role": "user", "content": "Write a Python function."}],
        max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 0 < u.completion_tokens <= 20
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny-target", messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens <= 16
    whole = client.chat.completions.create(
        model="tiny-target", messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=16, temperature=0)
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_and_not(client):
    r = client.completions.create(model="tiny-target", prompt="import os\n", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-target", prompt="import os\n", max_tokens=12, temperature=0, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-target", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and len(lp[0].top_logprobs) == 2
    assert lp[0].logprob == pytest.approx(lp[0].top_logprobs[0].logprob, abs=1e-5)


def test_client_disconnect_aborts_at_decode_and_frees_blocks(mesh):
    import asyncio
    import time

    import aiohttp

    from .helpers import micro_stats

    async def run():
        before = await micro_stats(mesh.nats_url, "decode")
        async with aiohttp.ClientSession() as http:
            r = await http.post(mesh.url + "/v1/completions", json={
                "model": "tiny-target", "prompt": "def f():", "max_tokens": 3000,
                "ignore_eos": True, "stream": True})
            n = 0
            async for _ in r.content:
                n += 1
                if n == 5:
                    break
            r.close()   # the client goes away mid-stream
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = await micro_stats(mesh.nats_url, "decode")
            if st["aborts"] > before.get("aborts", 0) and st["running"] == 0 \
                    and st["blocks_used"] == 0:
                return True
            await asyncio.sleep(0.3)
        return False

    assert asyncio.run(run())
