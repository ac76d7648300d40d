"""A coding-agent workload for the prefix-cache benchmarks (scripts/bench_hicache.py,
scripts/bench_layersplit.py): multi-turn sessions whose context grows by appending (each
turn = the previous prompt + the model's answer + new tool output), sessions interleaved
round-robin, and every turn sent to each mesh back to back, so machine noise hits them
alike. The text is Python stdlib source, tokenized; the sessions are the same every run
(seed 0)."""
from __future__ import annotations

import inspect
import json
import random
import time
from pathlib import Path

from pdmesh.bench.loadgen import completion_body


def corpus(tok) -> list[int]:
    import argparse as a
    import asyncio as b
    import json as c
    import logging as d
    import pathlib as e
    import shlex as f
    import textwrap as g
    return tok.encode("\n".join(inspect.getsource(m) for m in (a, b, c, d, e, f, g)))


async def ask(http, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion (PD forced, greedy): TTFT, output tokens, cached tokens."""
    body = completion_body(model, prompt, "pd", max_tokens)
    t0 = time.perf_counter()
    ttft, toks, usage = None, [], {}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            for c in ch.get("choices", []):
                if c.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - t0
                toks += c.get("token_ids") or []
            usage = ch.get("usage") or usage
    return {"ttft_s": ttft, "tokens": toks, "prompt_tokens": len(prompt),
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def start_sessions(text: list[int], n: int, start_tokens: int) -> list[dict]:
    """n sessions, each a window of the text to start from and where its tool output goes on."""
    rng = random.Random(0)
    sessions = []
    for _ in range(n):
        i = rng.randrange(0, len(text) - 20000)
        sessions.append({"prompt": text[i:i + start_tokens], "pos": i + start_tokens})
    return sessions


async def run_turns(args, meshes: dict, tok, follow: str) -> tuple[dict, list[int]]:
    """args: model, sessions, turns, start_tokens, append_tokens, max_tokens. Every turn of
    every session goes to each mesh; the next turn appends mesh `follow`'s answer and new
    tool output. -> ({mesh: [session][turn] -> ttft_s, prompt_tokens, cached_tokens},
    the working set (every session's context, tokens) at each turn's start)."""
    import aiohttp

    text = corpus(tok)
    model = Path(args.model).name
    sessions = start_sessions(text, args.sessions, args.start_tokens)
    res = {name: [[None] * args.turns for _ in sessions] for name in meshes}
    working = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(600)) as http:
        for turn in range(args.turns):
            working.append(sum(len(s["prompt"]) for s in sessions))
            for si, s in enumerate(sessions):
                answers = {}
                for name, m in meshes.items():
                    r = await ask(http, m.url, model, s["prompt"], args.max_tokens)
                    res[name][si][turn] = {k: r[k] for k in ("ttft_s", "prompt_tokens",
                                                             "cached_tokens")}
                    answers[name] = r["tokens"]
                print(f"turn {turn + 1}/{args.turns} session {si + 1}/{len(sessions)} "
                      f"prompt {len(s['prompt'])}: " + "  ".join(
                          f"{n} {res[n][si][turn]['ttft_s'] * 1e3:.0f} ms "
                          f"({res[n][si][turn]['cached_tokens']} cached)" for n in meshes),
                      flush=True)
                tool = text[s["pos"]:s["pos"] + args.append_tokens]
                s["pos"] += args.append_tokens
                s["prompt"] = s["prompt"] + answers[follow] + tool
    return res, working
