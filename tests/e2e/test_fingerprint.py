"""Prefill and decode that disagree about the tokenizer never produce output from the
wrong vocabulary and never a 500: decode refuses what is not its own, and the request is
served colocated (or refused with a clear 503 when no compatible decode exists)."""
from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp

from pdmesh.local.cluster import Cluster
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete, micro_stats


def variant_tokenizer_model(src, dst):
    """The same weights with one added token renamed: a different tokenizer fingerprint."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        if t["content"] == "</tool_response>":
            t["content"] = "</tool_result>"
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_prefill_with_other_tokenizer_is_refused_and_served_colocated(tiny_target, tiny_prompts,
                                                                      tmp_path):
    other = variant_tokenizer_model(tiny_target, tmp_path / "other")
    ov = det_overrides(mode="pd")
    ov["prefill"] = ov["prefill"] | {"model": str(other)}
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=ov, echo=False) as c:
        async def run():
            async with aiohttp.ClientSession() as http:
                return [await complete(http, c.url, p, temperature=0.0, max_tokens=8,
                                       ignore_eos=True) for p in tiny_prompts[:3]]

        got = asyncio.run(run())
        eng = reference_engine(tiny_target)
        for p, (toks, _) in zip(tiny_prompts[:3], got):
            assert toks == eng.generate([p], SamplingParams(temperature=0.0, max_tokens=8,
                                                            ignore_eos=True))[0]["token_ids"]
        dec = asyncio.run(micro_stats(c.nats_url, "decode"))
        assert dec["prefill_fallbacks"] == 3 and dec["kv_writes_applied"] == 0


def test_decode_with_other_tokenizer_gets_clear_503_not_500(tiny_target, tmp_path):
    other = variant_tokenizer_model(tiny_target, tmp_path / "other")
    ov = det_overrides()
    ov["decode"] = ov["decode"] | {"model": str(other)}
    with Cluster(str(tiny_target), prefill=0, decode=1, **DET, overrides=ov, echo=False,
                 startup_timeout_s=60) as c:
        async def run():
            async with aiohttp.ClientSession() as http:
                async with http.post(c.url + "/v1/completions", json={
                        "model": "tiny-target", "prompt": "x", "max_tokens": 4}) as r:
                    return r.status, await r.json()

        status, body = asyncio.run(run())
        assert status == 503
        assert "tokenizer" in body["error"]["message"]
