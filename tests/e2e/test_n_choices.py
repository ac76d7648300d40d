"""`n > 1` on chat and completions: choice i is a single request with seed s + i; the
prompt is prefilled once and choices 1..n-1 attach its whole blocks from the decode
instance's L1 (decode's prefix_hit_tokens grows by ~(n-1) x the prompt's whole chunks);
usage counts the prompt once; streams carry each choice's index (official openai client);
PD and colocated give the same choices (deterministic mode)."""
from __future__ import annotations

import asyncio
import inspect
import json

import aiohttp
import openai
import pytest

from shared.contracts.sampling import SamplingParams

from .conftest import ENGINE_SHAPES, reference_engine
from .helpers import micro_stats

CHUNK = ENGINE_SHAPES["chunk_size"]       # deterministic mode shares whole chunks


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0)


def prompt_for(tok, tag: str, n_tokens: int = 150) -> list[int]:
    return tok.encode(f"# {tag}\n" + inspect.getsource(json))[:n_tokens]


async def post(url: str, body: dict) -> tuple[dict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            return data, dict(r.headers)


def completion(mesh, prompt, **kw) -> tuple[dict, dict]:
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True} | kw
    return asyncio.run(post(mesh.url, body))


def decode_hits(mesh) -> int:
    return asyncio.run(micro_stats(mesh.nats_url, "decode"))["prefix_hit_tokens"]


@pytest.mark.parametrize("path", ["pd", "colocated", None])
def test_greedy_choices_are_equal_and_the_prompt_is_prefilled_once(mesh, tiny_target,
                                                                   tiny_tokenizer, path):
    prompt = prompt_for(tiny_tokenizer, f"greedy {path}")
    before = decode_hits(mesh)
    data, headers = completion(mesh, prompt, n=3, temperature=0.0,
                               **({"pdmesh_path": path} if path else {}))
    hits = decode_hits(mesh) - before
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    want = reference_engine(tiny_target, prefix_cache=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert all(c["token_ids"] == want["token_ids"] for c in choices)
    assert headers["x-pdmesh-path"] == (path or "pd")
    u = data["usage"]
    assert u["prompt_tokens"] == len(prompt) and u["completion_tokens"] == 3 * 12
    assert u["total_tokens"] == len(prompt) + 36
    whole = len(prompt) // CHUNK * CHUNK
    # choices 1 and 2 attached every whole chunk of the prompt from decode's L1; choice 0
    # found nothing there (a fresh prompt, computed once)
    assert 2 * whole <= hits <= 2 * whole + CHUNK, (hits, whole)


def test_seeded_choices_equal_single_requests_with_seeds_s_s1_s2(mesh, tiny_tokenizer):
    prompt, seed = prompt_for(tiny_tokenizer, "seeded", 100), 4242
    sampling = {"temperature": 1.0, "top_p": 1.0}
    singles = [completion(mesh, prompt, seed=seed + i, **sampling)[0]["choices"][0]["token_ids"]
               for i in range(3)]
    assert len({tuple(s) for s in singles}) == 3, "three seeds, three different generations"
    for path in ("pd", "colocated"):
        data, _ = completion(mesh, prompt, n=3, seed=seed, pdmesh_path=path, **sampling)
        assert [c["token_ids"] for c in data["choices"]] == singles, path
        assert [c["index"] for c in data["choices"]] == [0, 1, 2]


def test_streamed_choices_carry_their_index_openai_client(client, tiny_tokenizer):
    messages = [{"role": "user", "content": "Write a Python function that adds numbers."}]
    kw = dict(model="tiny-target", messages=messages, max_tokens=10, temperature=1.0,
              top_p=1.0, seed=77, n=3)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text, roles, finish = {}, {}, {}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        ch = c.choices[0]
        text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
        if ch.delta.role:
            roles[ch.index] = ch.delta.role
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert set(finish) == {0, 1, 2}
    assert [text[i] for i in range(3)] == [c.message.content for c in whole.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_n_openai_client(client):
    kw = dict(model="tiny-target", prompt="def fib(n):", max_tokens=8, temperature=0, n=2)
    whole = client.completions.create(**kw)
    got: dict[int, str] = {}
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert got == {0: whole.choices[0].text, 1: whole.choices[1].text}
    assert whole.choices[0].text == whole.choices[1].text          # greedy
