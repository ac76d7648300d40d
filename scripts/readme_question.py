"""The README's question, many times, to `pdmesh up` at its defaults: how many answers say
Paris, how long they run, and what the repetition monitor did; then the same with the
monitor off (--set decode.monitor=false), one run each.

    python scripts/readme_question.py [--runs 100] [--concurrency 8] [--out docs/bench]

Each run starts `pdmesh up` (the default model, its defaults: int4, n-gram speculation,
the model card's sampling) on a free port, sends the README's request with no sampling
fields `--runs` times, `--concurrency` at once, and stops it. Writes
<out>/readme_question.json and .png.

`first_token` in the JSON says why the Paris share is what it is: the served model's own
first-token distribution (top_logprobs of one request, raw logits), and transformers'
float32 and bfloat16 forward of the same checkpoint for reference, each as probabilities
at the model card's temperature (0.2). `--odds-only` measures just that, into the JSON
already there.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

import aiohttp

from pdmesh.bench.http import start_up, stop

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def log(msg: str) -> None:
    print(f"[readme_question {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def ask_all(url: str, runs: int, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(http):
        nonlocal done
        async with sem, http.post(url + "/v1/chat/completions", json=BODY) as r:
            body = await r.json()
        done += 1
        if done % 10 == 0:
            log(f"  {done}/{runs}")
        if r.status != 200:
            return {"status": r.status, "error": body}
        ch = body["choices"][0]
        return {"status": 200, "tokens": body["usage"]["completion_tokens"],
                "paris": "Paris" in (ch["message"]["content"] or ""),
                "finish": ch["finish_reason"], "stop_reason": ch.get("stop_reason"),
                "text": ch["message"]["content"][:120]}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(900)) as http:
        return await asyncio.gather(*(one(http) for _ in range(runs)))


TEMPERATURE = 0.2      # the model card's (services/gateway/defaults.py reads it)


def at_temperature(logprobs: dict[str, float]) -> dict[str, float]:
    """Top tokens' raw logprobs -> their probabilities at TEMPERATURE (over these tokens:
    at 0.2 the rest of the vocabulary holds a negligible share)."""
    import math
    z = {t: lp / TEMPERATURE for t, lp in logprobs.items()}
    top = max(z.values())
    tot = sum(math.exp(v - top) for v in z.values())
    return {t: round(math.exp(v - top) / tot, 4) for t, v in z.items()}


async def served_first_token(url: str) -> dict:
    body = BODY | {"max_tokens": 1, "logprobs": True, "top_logprobs": 5}
    async with aiohttp.ClientSession() as http, \
            http.post(url + "/v1/chat/completions", json=body) as r:
        out = await r.json()
    top = out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    raw = {t["token"]: round(t["logprob"], 4) for t in top}
    return {"logprobs": raw, "p_at_t0.2": at_temperature(raw)}


def reference_first_token(model_dir: Path) -> dict:
    """transformers' forward of the served checkpoint, float32 and bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(BODY["messages"], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        with torch.no_grad():
            lp = torch.log_softmax(m(ids).logits[0, -1].float(), -1)
        top = torch.topk(lp, 5)
        raw = {tok.decode([i]): round(v, 4) for v, i in zip(top.values.tolist(),
                                                             top.indices.tolist())}
        out[f"transformers_{str(dtype).split('.')[-1]}"] = {
            "logprobs": raw, "p_at_t0.2": at_temperature(raw)}
    return out


def model_dir(logfile: Path) -> Path | None:
    """The folder `pdmesh up` served (its log names it), for the reference forward."""
    m = re.search(r"default model from (/\S+)", logfile.read_text())
    return Path(m.group(1)) if m and Path(m.group(1)).is_dir() else None


async def anomalies(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'pdmesh_anomaly_aborts_total\{rule="(\w+)"\} (\S+)', text)}


def summary(answers: list[dict]) -> dict:
    ok = [a for a in answers if a["status"] == 200]
    tokens = sorted(a["tokens"] for a in ok)
    return {"runs": len(answers), "ok": len(ok), "paris": sum(a["paris"] for a in ok),
            "over_300_tokens": sum(t > 300 for t in tokens),
            "at_cap_512": sum(t >= 512 for t in tokens), "max_tokens": max(tokens, default=0),
            "median_tokens": tokens[len(tokens) // 2] if tokens else 0,
            "cut_for_repetition": sum(a.get("stop_reason") == "repetition" for a in ok)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--odds-only", action="store_true",
                    help="only the first-token distribution, into the JSON already there")
    a = ap.parse_args()
    out = Path(a.out)
    res = {"runs": a.runs, "concurrency": a.concurrency, "body": BODY, "modes": {}}
    if a.odds_only:
        res = json.loads((out / "readme_question.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("defaults", []),
                            ("monitor_off", ["--set", "decode.monitor=false"])):
            log(f"{name}: pdmesh up {' '.join(extra)}")
            proc, url = start_up(extra, Path(tmp) / f"{name}.log")
            try:
                if name == "defaults":
                    res["first_token"] = {"served": asyncio.run(served_first_token(url))}
                    folder = model_dir(Path(tmp) / f"{name}.log")
                    if folder is not None:
                        res["first_token"] |= reference_first_token(folder)
                    log(f"first token: {res['first_token']}")
                if a.odds_only:
                    break
                answers = asyncio.run(ask_all(url, a.runs, a.concurrency))
                res["modes"][name] = {"summary": summary(answers),
                                      "anomaly_aborts": asyncio.run(anomalies(url)),
                                      "answers": answers}
            finally:
                stop(proc)
            log(f"{name}: {res['modes'][name]['summary']} anomaly aborts "
                f"{res['modes'][name]['anomaly_aborts']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "readme_question.json").write_text(json.dumps(res, indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, m in res["modes"].items():
        toks = [x["tokens"] for x in m["answers"] if x["status"] == 200]
        s = m["summary"]
        ax.hist(toks, bins=range(0, 530, 16), alpha=0.6,
                label=f"{name}: Paris {s['paris']}/{s['runs']}, >300 tokens {s['over_300_tokens']}")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("answers")
    ax.set_title(f"'What is the capital of France?' x{a.runs}, pdmesh up defaults")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "readme_question.png")
    log(f"wrote {out / 'readme_question.json'} and .png")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
