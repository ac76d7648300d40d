"""Architectures other than Llama over the whole mesh: tiny random GLM-4 (partial
interleaved RoPE, post-norms, q/k/v biases, fused gate|up; the family of the deployments
this project exists to fix), Gemma 2 (local/global layers with a window the prompts
pass, soft-capped scores and logits), Qwen3-MoE (8 experts, top 2) and Mixtral (every layer
sparse, a sliding window) checkpoints, written by transformers' own classes with
the tiny model's tokenizer beside them. PD == colocated == the engine alone, token for token
(deterministic mode), greedy and seeded sampling: the KV wire's shapes come from the config,
and prefill's KV is the KV decode would have computed. tool_choice "required" gives the
same schema-valid call on both paths."""
from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import jsonschema
import pytest

from pdmesh.bench.workloads import TOOLS
from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams
from tests.engine.test_archs import checkpoint

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete, micro_stats

SHAPES = {
    "glm4": ("Glm4Config", dict(head_dim=16, attention_bias=True,
                                eos_token_id=0)),   # the tiny tokenizer's, not GLM's 151329
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=4, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=4.0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=32, sliding_window=4)),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request, tiny_target, tmp_path_factory):
    # named as the tiny model, which the helpers ask for by name
    cls, fields = SHAPES[request.param]
    path = checkpoint(tmp_path_factory.mktemp(request.param) / "tiny-target", cls,
                      vocab_size=8192, num_attention_heads=4, num_key_value_heads=2,
                      pad_token_id=0, max_position_embeddings=2048, **fields)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / f, path / f)
    return path


def test_pd_equals_colocated_equals_engine(model, tiny_prompts):
    assert min(len(p) for p in tiny_prompts[:6]) > 4       # past Gemma's window
    eng = reference_engine(model)
    todo = [(p, dict(temperature=0.0, max_tokens=16) if i % 2 == 0 else
             dict(temperature=0.8, top_p=0.95, seed=i, max_tokens=16))
            for i, p in enumerate(tiny_prompts[:6])]
    want = [eng.generate([p], SamplingParams(ignore_eos=True, **kw))[0]["token_ids"]
            for p, kw in todo]
    with Cluster(str(model), prefill=1, decode=1, **DET, overrides=det_overrides(),
                 echo=False) as c:
        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
                return [await complete(http, c.url, p, path=path, ignore_eos=True, **kw)
                        for p, kw in todo for path in ("pd", "colocated")]

        got = iter(asyncio.run(run()))
        for (_, kw), w in zip(todo, want):
            for path in ("pd", "colocated"):
                toks, headers = next(got)
                assert headers["x-pdmesh-path"] == path and toks == w, (path, kw)
        prefill = asyncio.run(micro_stats(c.nats_url, "prefill"))
        assert prefill["jobs_done"] >= len(todo) and prefill["kv_bytes"] > 0
        # Mixtral slides on every layer: decode gave back what no token could see any more
        # (after the prefill's blocks landed), and still answered as the engine alone
        evicted = asyncio.run(micro_stats(c.nats_url, "decode"))["blocks_evicted"]
        assert (evicted > 0) == (model.parent.name.startswith("mixtral")), evicted
        # tool_choice "required" (the GLM-5 deployments' HTTP 500): on either path the
        # grammar forces a call, the same call, whose arguments fit the tool's schema
        answers = asyncio.run(_required_tool_call(c.url))
        calls = [[(t["function"]["name"], t["function"]["arguments"])
                  for t in a["message"].get("tool_calls") or []] for a in answers]
        assert calls[0] == calls[1] and answers[0]["finish_reason"] == \
            answers[1]["finish_reason"], answers
        if answers[0]["finish_reason"] == "tool_calls":
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            for name, args in calls[0]:
                jsonschema.validate(json.loads(args), schemas[name])
        else:                                   # cut by max_tokens inside the call
            assert answers[0]["finish_reason"] == "length", answers


async def _required_tool_call(url: str) -> list[dict]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(120)) as http:
        for path in ("pd", "colocated"):
            body = {"model": "tiny-target", "tools": TOOLS, "tool_choice": "required",
                    "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "max_tokens": 96, "temperature": 0, "pdmesh_path": path}
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                out.append((await r.json())["choices"][0])
    return out
