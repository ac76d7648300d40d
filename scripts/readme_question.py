"""The README's question, many times, to `pdmesh up` at its defaults: how many answers say
Paris, how long they run, and what the repetition monitor did; then the same with the
monitor off (--set decode.monitor=false), one run each.

    python scripts/readme_question.py [--runs 100] [--concurrency 8] [--out docs/bench]

Each run starts `pdmesh up` (the default model, its defaults: int4, n-gram speculation,
the model card's sampling) on a free port, sends the README's request with no sampling
fields `--runs` times, `--concurrency` at once, and stops it. Writes
<out>/readme_question.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def log(msg: str) -> None:
    print(f"[readme_question {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def up(extra: list[str], logfile: Path) -> tuple[subprocess.Popen, str]:
    out = open(logfile, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdmesh", "up", "--port", "0", *extra],
                            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"pdmesh up did not start:\n{logfile.read_text()[-3000:]}")
        m = re.search(r"pdmesh is up: (http://\S+)", logfile.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.5)


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
    a = ap.parse_args()
    res = {"runs": a.runs, "concurrency": a.concurrency, "body": BODY, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("defaults", []),
                            ("monitor_off", ["--set", "decode.monitor=false"])):
            log(f"{name}: pdmesh up {' '.join(extra)}")
            proc, url = up(extra, Path(tmp) / f"{name}.log")
            try:
                answers = asyncio.run(ask_all(url, a.runs, a.concurrency))
                res["modes"][name] = {"summary": summary(answers),
                                      "anomaly_aborts": asyncio.run(anomalies(url)),
                                      "answers": answers}
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log(f"{name}: {res['modes'][name]['summary']} anomaly aborts "
                f"{res['modes'][name]['anomaly_aborts']}")
    out = Path(a.out)
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
