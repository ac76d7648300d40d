"""The cost of issue 29's KV checks, side by side with what came before, in one run:

  kv    KV writes over a real nats-server (auth on: the prefill user sends, the decode user
        answers), a window of 8 like prefill's KvSender, 64 KiB / 1 MiB / 4 MiB payloads.
        Decode's side runs in a process of its own, as in the mesh.
        `before`: the linear checksum (8-byte words times fixed odd weights, numpy's dot:
        the removed write_checksum) on both sides, nothing else. `checks`: the product's
        path: BLAKE3 over header and payload when sending, and decode's
        transport.receive (admission on the header against a grant, size, digest) when
        answering. Rounds alternate, so machine noise hits both alike.
  ttft  PD time to first token through `Cluster` (PD forced), the previous tree (git
        worktree at --before, the commit before the KV changes) against this one, one
        mesh after the other, round after round, at c=1 and c=16 on the default model.

Writes docs/bench/kv_checks.json and .png (ratios checks / before).

    .venv/bin/python scripts/bench_kv_checks.py [--rounds 3] [--before fac0a6b]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import nats
import numpy as np

from pdmesh.bench.rawnats import log
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.kv import wire
from shared.kv.transport import receive

ROOT = Path(__file__).resolve().parent.parent



SIZES = (64 << 10, 1 << 20, 4 << 20)
WINDOW = 8
ACK = msgspec.json.Encoder()
_W = np.random.default_rng(0x6B76).integers(0, 1 << 63, size=(8 << 20) // 8,
                                            dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def linear_sum(data) -> int:
    """The removed write_checksum's words: sum of 8-byte words times odd weights."""
    n = len(data) // 8
    return int(np.dot(np.frombuffer(data, dtype=np.uint64, count=n), _W[:n]))


async def linear_async(data) -> int:
    if len(data) < wire.OFFLOAD_BYTES:
        return linear_sum(data)
    return await asyncio.get_running_loop().run_in_executor(None, linear_sum, data)


def meta_for(size: int, i: int) -> KvWrite:
    per_block = 2 * 16 * 3 * 64 * 2 * 30            # SmolLM2-135M: one block, all layers
    n = max(1, size // per_block)
    return KvWrite(request_id=f"r{i % 64}", epochs=list(range(7, 7 + n)),
                   block_ids=list(range(n)), layer_start=0, layer_end=30, dtype="bfloat16",
                   shape=[30, 2, n, 16, 3, 64], seq=i, sender="prefill_0", attempt="a")


class Grants:
    """A request table's worth of grants to admit against (RequestTable.granted's work)."""

    def __init__(self):
        self.blocks = {f"r{i}": frozenset(range(4096)) for i in range(64)}

    def admit(self, m: KvWrite) -> bool:
        b = self.blocks.get(m.request_id)
        return b is not None and m.attempt == "a" and set(m.block_ids) <= b


async def kv_round(variant: str, tx, subject: str, size: int, total: int) -> float:
    meta = meta_for(size, 0)
    payload = bytes(np.random.default_rng(size).integers(0, 255, wire.write_bytes(meta),
                                                        dtype=np.uint8))
    sem, sent = asyncio.Semaphore(WINDOW), 0

    async def one(i: int) -> None:
        async with sem:
            m = msgspec.structs.replace(meta, seq=i, request_id=f"r{i % 64}")
            if variant == "checks":
                m = msgspec.structs.replace(m, digest=await wire.digest_async(m, payload))
                headers = m.headers()
            else:
                headers = m.headers() | {"Pdmesh-sum": str(await linear_async(payload))}
            await tx.request(subject, payload, headers=headers, timeout=30)
    n = max(WINDOW, total // len(payload))
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    sent = n * len(payload)
    return sent / (time.perf_counter() - t)


async def responder(url: str, creds: str) -> None:
    """Decode's side, in its own process (as in the mesh): both variants' listeners, as
    the decode user; exits when stdin closes."""
    from pdmesh.deploy.creds import Secrets

    sec = Secrets.create(Path(creds), keep=True)
    rx = await nats.connect(url, **sec.auth("decode").options(), pending_size=64 << 20)
    grants = Grants()

    async def on_write(m, data) -> KvWriteAck:
        return KvWriteAck(request_id=m.request_id, seq=m.seq, applied=data is not None)

    async def checks(msg) -> None:
        m = KvWrite.from_headers(msg.headers)
        ack = await receive(m, lambda: msg.data, on_write, grants.admit)
        await msg.respond(ACK.encode(ack))

    async def before(msg) -> None:
        m = KvWrite.from_headers(msg.headers)
        ok = await linear_async(msg.data) == int(msg.headers["Pdmesh-sum"])
        await msg.respond(ACK.encode(KvWriteAck(request_id=m.request_id, seq=m.seq,
                                                applied=ok)))
    await rx.subscribe("pdmesh.decode.kv.bench_checks", cb=checks,
                       pending_bytes_limit=512 << 20)
    await rx.subscribe("pdmesh.decode.kv.bench_before", cb=before,
                       pending_bytes_limit=512 << 20)
    await rx.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await rx.close()


async def kv_part(rounds: int, total_mb: int) -> dict:
    from pdmesh.deploy.creds import Secrets
    from pdmesh.local.cluster import free_port, nats_server_binary

    tmp = Path(tempfile.mkdtemp(prefix="kvchecks-"))
    sec = Secrets.create(tmp / "creds")
    port = free_port()
    (tmp / "n.conf").write_text(f"listen: 127.0.0.1:{port}\nmax_payload: 8MB\n"
                                f"include \"creds/auth.conf\"\n")
    srv = subprocess.Popen([nats_server_binary(), "-c", str(tmp / "n.conf")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await asyncio.sleep(0.5)
    url = f"nats://127.0.0.1:{port}"
    rx = subprocess.Popen([sys.executable, __file__, "--responder", url, str(tmp / "creds")],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if rx.stdout.readline().strip() != "ready":
        raise RuntimeError("KV responder did not start")
    tx = await nats.connect(url, **sec.auth("prefill").options(), pending_size=64 << 20)
    res = {v: {str(s): [] for s in SIZES} for v in ("before", "checks")}
    try:
        for v in ("before", "checks"):                     # warm-up
            await kv_round(v, tx, f"pdmesh.decode.kv.bench_{v}", 1 << 20, 16 << 20)
        for r in range(rounds):
            for size in SIZES:
                for v in (("before", "checks") if r % 2 == 0 else ("checks", "before")):
                    bps = await kv_round(v, tx, f"pdmesh.decode.kv.bench_{v}", size,
                                         total_mb << 20)
                    res[v][str(size)].append(bps)
                    log(f"kv round {r + 1}/{rounds} {size >> 10} KiB {v}: {bps / 1e6:.1f} MB/s")
    finally:
        await tx.close()
        rx.stdin.close()
        rx.wait(10)
        srv.terminate()
    return res


TTFT_CHILD = r"""
import asyncio, json, sys
import aiohttp
from pdmesh.local.cluster import Cluster
from pdmesh.bench.loadgen import completion_body, run_level
model, n1, n16 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
PROMPT = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n" * 40
async def go(c):
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        name = c.model.rstrip("/").rsplit("/", 1)[-1]
        bodies = lambda n, tag: [completion_body(name, f"# {tag} {i}\n" + PROMPT, "pd", 4)
                                 for i in range(n)]
        await run_level(http, c.url, bodies(2, "warm"), 1, "warm")
        for conc, n in ((1, n1), (16, n16)):
            r = await run_level(http, c.url, bodies(n, f"c{conc}"), conc, f"c={conc}")
            out[f"c{conc}"] = {"ttft_p50_s": r["ttft_s"]["p50"], "ok": r["ok"],
                               "errors": r["errors"], "prompt_tokens": r["prompt_tokens_mean"],
                               "error_samples": r["error_samples"]}
    return out
with Cluster(model, prefill=1, decode=1, echo=False,
             overrides={"decode": {"mode": "pd"}}) as c:
    print("RESULT " + json.dumps(asyncio.run(go(c))), flush=True)
"""


def ttft_once(tree: Path, model: str, n1: int, n16: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", TTFT_CHILD, model, str(n1), str(n16)],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"ttft run in {tree} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def ttft_part(rounds: int, before_rev: str, model: str, n1: int, n16: int) -> dict:
    old = Path(tempfile.mkdtemp(prefix="kvchecks-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "-f", "--detach", str(old), before_rev],
                   cwd=ROOT, check=True, capture_output=True)
    res = {"before": [], "checks": []}
    try:
        for r in range(rounds):
            for v in (("before", "checks") if r % 2 == 0 else ("checks", "before")):
                log(f"ttft round {r + 1}/{rounds}: {v} ({old if v == 'before' else ROOT})")
                res[v].append(ttft_once(old if v == "before" else ROOT, model, n1, n16))
                log(f"  {res[v][-1]}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                       capture_output=True)
    return res


def summarize(kv: dict, ttft: dict) -> dict:
    med = statistics.median
    out = {"kv_bytes_per_s": {}, "kv_ratio_checks_over_before": {}, "ttft": {}}
    for s in map(str, SIZES):
        b, c = med(kv["before"][s]), med(kv["checks"][s])
        out["kv_bytes_per_s"][s] = {"before": b, "checks": c}
        out["kv_ratio_checks_over_before"][s] = c / b
    for level in ("c1", "c16"):
        b = med(x[level]["ttft_p50_s"] for x in ttft["before"])
        c = med(x[level]["ttft_p50_s"] for x in ttft["checks"])
        out["ttft"][level] = {"before_p50_s": b, "checks_p50_s": c, "ratio": c / b,
                              "failed": sum(x[level]["errors"] for v in ttft.values()
                                            for x in v)}
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = list(summary["kv_bytes_per_s"])
    x = np.arange(len(sizes))
    for i, v in enumerate(("before", "checks")):
        a.bar(x + i * 0.4, [summary["kv_bytes_per_s"][s][v] / 1e6 for s in sizes], 0.4,
              label=v)
    a.set_xticks(x + 0.2, [f"{int(s) >> 10} KiB" for s in sizes])
    a.set_ylabel("MB/s")
    a.set_title("KV writes over NATS (window 8)")
    a.legend()
    levels = list(summary["ttft"])
    x = np.arange(len(levels))
    for i, v in enumerate(("before_p50_s", "checks_p50_s")):
        b.bar(x + i * 0.4, [summary["ttft"][lv][v] * 1e3 for lv in levels], 0.4,
              label=v.split("_")[0])
    b.set_xticks(x + 0.2, levels)
    b.set_ylabel("PD TTFT p50 (ms)")
    b.set_title("PD TTFT, previous tree vs this one")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-mb", type=int, default=512, help="MiB per KV measurement")
    ap.add_argument("--before", default="fac0a6b", help="the tree before the KV checks")
    ap.add_argument("--model", default=str(Path.home() / ".cache/pdmesh/models/"
                                                            "SmolLM2-135M-Instruct"))
    ap.add_argument("--n1", type=int, default=8)
    ap.add_argument("--n16", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "kv_checks"))
    ap.add_argument("--responder", nargs=2, metavar=("URL", "CREDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.responder:
        asyncio.run(responder(*args.responder))
        return 0
    kv = asyncio.run(kv_part(args.rounds, args.kv_mb))
    ttft = ttft_part(args.rounds, args.before, args.model, args.n1, args.n16)
    report = {"args": vars(args), "kv": kv, "ttft": ttft, "summary": summarize(kv, ttft)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report["summary"], out.with_suffix(".png"))
    log(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
