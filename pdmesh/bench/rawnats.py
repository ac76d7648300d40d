"""The raw NATS baseline for `pdmesh bench`: the same payload sizes the mesh's KV writes
had, sent as nats-py requests to a plain responder in its own process, with a window of
outstanding requests — what a Python transport over this nats-server can do at best."""
from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from shared.natsconn import connect_kwargs

RAW_REPS = 3        # the raw baseline's bytes/s: median of this many runs (--raw-mb in all)


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def responder_main(subject: str, nats_url: str, auth=None) -> int:
    """A plain responder: reply to every request at once; exit when stdin closes. With
    `auth` (a shared.natsconn.NatsAuth) it connects as that user."""
    import nats



    ack = b'{"applied":true}'
    opts = connect_kwargs(nats_url, auth) if auth is not None else {"servers": nats_url}
    nc = await nats.connect(**opts, pending_size=64 << 20)

    async def on_msg(msg) -> None:
        await msg.respond(ack)

    await nc.subscribe(subject, cb=on_msg, pending_bytes_limit=256 << 20)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()
    return 0


class Responder:
    """The responder in its own process (like decode, not sharing the sender's loop)."""

    def __init__(self, nats_url: str):
        from shared import subjects

        self.subject = subjects.bench_raw(uuid.uuid4().hex[:12])
        self.nats_url = nats_url
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> "Responder":
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh.bench.run", "--raw-responder", self.subject,
             "--nats-url", self.nats_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True)
        line = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline), 30)
        if line.strip() != "ready":
            self.close()
            raise BenchError(f"raw responder did not start (exit {self.proc.poll()})")
        return self

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(5)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)


async def raw_run(nc, subject: str, size: int, window: int, total_bytes: float,
                  max_s: float) -> dict:
    """Requests of `size` bytes, at most `window` unanswered (like prefill's KvSender)."""
    payload = bytes(size)
    n = max(4 * window, math.ceil(total_bytes / size))
    sent = 0
    nbytes = 0
    stop_at = time.perf_counter() + max_s

    async def lane() -> None:
        nonlocal sent, nbytes
        while sent < n and time.perf_counter() < stop_at:
            sent += 1
            await nc.request(subject, payload, timeout=10)
            nbytes += size

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(window)))
    el = time.perf_counter() - t0
    return {"payload_bytes": size, "window": window, "messages": sent, "bytes": nbytes,
            "seconds": el, "bytes_per_s": nbytes / el if el > 0 else None,
            "capped": sent < n}


async def raw_baseline(nats_url: str, sizes: list[int], windows: list[int], total_bytes: float,
                       max_s: float) -> list[dict]:
    import nats

    nc = await nats.connect(**connect_kwargs(nats_url), pending_size=64 << 20)
    out = []
    try:
        async with Responder(nats_url) as resp:
            for size in sizes:
                size = max(1, min(int(size), nc.max_payload - 4096))
                for w in windows:
                    payload = bytes(size)
                    for _ in range(2):     # warm-up
                        await asyncio.gather(*(nc.request(resp.subject, payload, timeout=10)
                                               for _ in range(w)))
                    reps = [await raw_run(nc, resp.subject, size, w, total_bytes / RAW_REPS,
                                          max_s / RAW_REPS) for _ in range(RAW_REPS)]
                    r = sorted(reps, key=lambda x: x["bytes_per_s"] or 0)[len(reps) // 2]
                    r = r | {"reps_bytes_per_s": [x["bytes_per_s"] for x in reps],
                             "messages": sum(x["messages"] for x in reps),
                             "capped": any(x["capped"] for x in reps)}
                    log(f"  raw NATS {size / 1024:.1f} KiB x window {w}: "
                        f"{r['bytes_per_s'] / 1e6:.1f} MB/s (median of {RAW_REPS}: "
                        + ", ".join(f"{x / 1e6:.0f}" for x in r["reps_bytes_per_s"])
                        + f"; {r['messages']} requests)")
                    out.append(r)
    finally:
        await nc.close()
    return out


async def idle_round_trips(nats_url: str, idle_s: float, n: int = 40) -> dict:
    """Round trips of a small request to a responder in its own process, each after
    `idle_s` of silence (both sides idle, as decode and prefill are around a compute):
    what two cross-process NATS hops cost on this host at best. A PD request has two more
    such hops on its critical path than a colocated one (the job to prefill, its KV and
    PrefillDone back to decode)."""
    import statistics

    import nats

    nc = await nats.connect(**connect_kwargs(nats_url))
    rtts = []
    try:
        async with Responder(nats_url) as resp:
            for i in range(n + 3):                       # 3 warm-ups
                await asyncio.sleep(idle_s)
                t0 = time.perf_counter()
                await nc.request(resp.subject, b"x" * 256, timeout=10)
                if i >= 3:
                    rtts.append(time.perf_counter() - t0)
    finally:
        await nc.close()
    return {"idle_s": idle_s, "n": len(rtts), "rtt_p50_s": statistics.median(rtts),
            "rtt_s": rtts}


def raw_for(raw: list[dict], size: int, window: int) -> dict | None:
    return next((r for r in raw if r["window"] == window
                 and r["payload_bytes"] == size), None)
