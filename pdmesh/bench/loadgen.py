"""Load generation for `pdmesh bench`: streamed completions, one concurrency level at a
time, with TTFT / inter-token latency / tokens-per-second statistics."""
from __future__ import annotations

import asyncio
import json
import math
import time

from pdmesh.bench.rawnats import BenchError, log


# ---- statistics ------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs) if xs else None, "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "n": len(xs)}


# ---- one streamed request ------------------------------------------------------------------
def completion_body(model: str, prompt: str, path: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "pdmesh_path": path}


async def stream_one(http, url: str, body: dict) -> dict:
    """POST a streamed completion; time every chunk that carries tokens."""
    t0 = time.perf_counter()
    first = last = None
    gaps: list[tuple[float, int]] = []
    ntok = 0
    usage = None
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise BenchError(f"HTTP {r.status}: {(await r.text())[:300]}")
        path = r.headers.get("x-pdmesh-path")
        async for raw in r.content:        # SSE: one `data: {...}` line per event
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise BenchError(f"stream error: {ev['error'].get('message')}")
            if ev.get("usage"):
                usage = ev["usage"]
            choices = ev.get("choices") or []
            n = len(choices[0].get("token_ids") or ()) if choices else 0
            if not n:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append((now - last, n))
            last = now
            ntok += n
    end = time.perf_counter()
    if first is None:
        raise BenchError("no token arrived")
    return {"ttft_s": first - t0, "itl_s": [g / n for g, n in gaps],
            "decode_s": sum(g for g, _ in gaps), "decode_tokens": sum(n for _, n in gaps),
            "tokens": (usage or {}).get("completion_tokens") or ntok, "streamed_tokens": ntok,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "path": path,
            "latency_s": end - t0}


async def run_level(http, url: str, bodies: list[dict], c: int, label: str) -> dict:
    """All bodies, at most c in flight; progress lines while it runs."""
    want = bodies[0].get("pdmesh_path")   # None: the gateway places each request
    queue = list(enumerate(bodies))
    results: list[dict] = []
    errors: list[str] = []
    done_tokens = 0
    every = max(1, len(bodies) // 8)
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal done_tokens
        while queue:
            _i, body = queue.pop(0)
            try:
                res = await stream_one(http, url, body)
            except Exception as e:  # noqa: BLE001 - counted and reported, the level goes on
                errors.append(f"{type(e).__name__}: {e}"[:300])
            else:
                results.append(res)
                done_tokens += res["tokens"]
            n = len(results) + len(errors)
            if n % every == 0 or n == len(bodies):
                el = time.perf_counter() - t0
                log(f"  {label}: {n}/{len(bodies)} done, {done_tokens / el:.1f} tok/s"
                    + (f", {len(errors)} failed" if errors else ""))

    await asyncio.gather(*(worker() for _ in range(min(c, len(bodies)))))
    wall = time.perf_counter() - t0
    itl = [x for r in results for x in r["itl_s"]]
    dec_s = sum(r["decode_s"] for r in results)
    dec_n = sum(r["decode_tokens"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    prompt = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]
    out = {
        "path": want, "concurrency": c, "requests": len(bodies), "ok": len(results),
        "errors": len(errors), "error_samples": errors[:3],
        "path_mismatch": sum(1 for r in results if want and r["path"] != want),
        "paths_seen": sorted({str(r["path"]) for r in results}),
        "ttft_s": summary([r["ttft_s"] for r in results]),
        "itl_s": summary(itl),
        "tpot_s": dec_s / dec_n if dec_n else None,     # token-weighted ITL
        "latency_s": summary([r["latency_s"] for r in results]),
        "completion_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
    }
    if out["path_mismatch"]:
        log(f"  {label}: WARNING {out['path_mismatch']} answers came back on another path "
            f"({out['paths_seen']})")
    return out


def fmt_level(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"
    tps = r["tokens_per_s"]
    return (f"TTFT p50 {ms(r['ttft_s']['p50'])} ms p90 {ms(r['ttft_s']['p90'])} ms | "
            f"ITL mean {ms(r['itl_s']['mean'])} ms p90 {ms(r['itl_s']['p90'])} ms | "
            f"{'-' if tps is None else f'{tps:.1f}'} tok/s | {r['ok']}/{r['requests']} ok")
