"""A server a benchmark talks to over HTTP: starting `pdmesh up` (`start_up`, `stop`),
waiting for a server it started (llama-server, pdmesh up) to answer (`wait_http`), and
one streamed completion timed as its client sees it (`timed_stream`)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UP_URL = re.compile(r"pdmesh is up: (http://\S+)")


def wait_http(url: str, path: str = "/v1/models", timeout: float = 600) -> None:
    """Until GET url+path answers 200; RuntimeError after timeout seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise RuntimeError(f"{url} did not come up")


def start(argv: list[str], logfile: Path, url: str | None = None,
          timeout: float = 600, cwd: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """Start a server (from checkout cwd), its output into logfile; (process, its URL)
    once it answers. url None: `pdmesh up` on --port 0, whose URL its log names."""
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=open(logfile, "w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while url is None:
        m = UP_URL.search(logfile.read_text())
        if m:
            url = m.group(1)
        elif proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{argv[0]} did not start:\n{logfile.read_text()[-3000:]}")
        else:
            time.sleep(0.5)
    wait_http(url, "/v1/models", max(1.0, deadline - time.monotonic()))
    return proc, url


def start_up(flags: list[str], logfile: Path) -> tuple[subprocess.Popen, str]:
    """`pdmesh up --port 0 <flags>` from this checkout."""
    return start([sys.executable, "-m", "pdmesh", "up", "--port", "0", *flags], logfile)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (pdmesh up stops its mesh), then kill after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def timed_stream(http, url: str, body: dict) -> dict:
    """POST a streamed /v1/completions body: {"ttft_s", "gaps_s" (between text chunks),
    "error"} as the client sees them (ttft_s None when no text came)."""
    t0 = time.perf_counter()
    ttft, last, gaps, err = None, None, [], None
    async with http.post(url + "/v1/completions", json=body | {"stream": True}) as r:
        if r.status != 200:
            return {"ttft_s": None, "gaps_s": [], "error": f"{r.status} {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])
            if "error" in ch:
                err = str(ch["error"])[:200]
            if not (ch.get("choices") or [{}])[0].get("text"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return {"ttft_s": ttft, "gaps_s": gaps, "error": err}
