"""KV transfer benchmark: prefill's KvSender over NATS and over shared memory, against raw
nats-py requests of the same size, in one run.

A decode-like receiver runs in its own process (NatsKvTransport.listen, every write
checked against its checksum and scattered into a KV pool, then acked); the sender is
prefill's KvSender (credit window, ledger, gather, checksum) over NatsKvTransport or
ShmKvTransport. Each sends one prompt's KV (default: SmolLM2-135M's shape, bf16, 2,000
tokens = 125 blocks x 30 layers, 46 MB) cut two ways: whole-prompt writes of up to the
server's max payload (8 MiB), and the layer-wise stream's writes (one layer of one 256-token
chunk: 16 blocks, 192 KiB). The raw baseline: rawnats.raw_baseline, the same payload sizes
and window as nats-py requests to a plain responder process. Writes
<out>/kv_transfer.json and .png.

    python -m pdmesh.bench.kv [--tokens 2000] [--reps 5] [--window 8] [--out docs/bench]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdmesh.bench.rawnats import log, raw_baseline
from pdmesh.bench.report import save

SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64, "block_size": 16}


def start_nats() -> tuple[subprocess.Popen, str, Path]:
    from pdmesh.deploy.natsconf import MAX_PAYLOAD, MAX_PENDING
    from pdmesh.local.launch import free_port, nats_server_binary

    port = free_port()
    d = Path(tempfile.mkdtemp(prefix="pdmesh-benchkv-"))
    # max_pending as the mesh's config sets it (natsconf.py): the raw baseline's window of
    # 8 x 7.5 MB requests sits at the server's default 64 MB a connection may fall behind
    (d / "nats.conf").write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {MAX_PAYLOAD}\n"
                                 f"max_pending: {MAX_PENDING}\n")
    with open(d / "nats.log", "wb") as logf:        # a slow consumer shows up here
        proc = subprocess.Popen([nats_server_binary(), "-c", str(d / "nats.conf")],
                                stdout=logf, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    return proc, f"nats://127.0.0.1:{port}", d


def pool(num_blocks: int, random: bool = False):
    import torch

    s = SMOLLM2
    shape = (s["layers"], 2, num_blocks, s["block_size"], s["kv_heads"], s["head_dim"])
    return torch.randn(shape).to(torch.bfloat16) if random else torch.zeros(shape,
                                                                           dtype=torch.bfloat16)


async def receiver_main(nats_url: str, num_blocks: int) -> int:
    from shared.contracts.kv import KvWriteAck
    from shared.kv import wire
    from shared.kv.nats_transport import NatsKvTransport
    from shared.service import ServiceRuntime

    rt = ServiceRuntime("decode", "bench_d0", nats_url)
    await rt.start()
    kv = pool(num_blocks)

    async def on_write(meta, payload):
        wire.unpack_into(kv, meta.block_ids, meta.layer_start, meta.layer_end, payload,
                         meta.dtype, meta.shape)
        return KvWriteAck(request_id=meta.request_id, seq=meta.seq, applied=True)

    await NatsKvTransport(rt).listen("bench_d0", on_write)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await rt.close()
    return 0


class _Engine:
    def __init__(self, kv, blocks):
        self.kv, self.blocks = kv, blocks

    def kept_blocks(self, local_id):
        return list(self.blocks)


def _job(n: int):
    from shared.contracts.messages import KvDestination, PrefillJob, SamplingParams

    return PrefillJob(request_id="bench", prompt_ids=[0], params=SamplingParams(),
                      tokenizer_fingerprint="", model="", block_size=SMOLLM2["block_size"],
                      dest=KvDestination(instance_id="bench_d0", block_ids=list(range(n)),
                                         epochs=[0] * n, skip_blocks=0))


def pieces(kind: str, n: int, kv, max_bytes: int):
    """The writes of one prompt: 'whole' as wire.plan cuts them, 'stream' as the layer-wise
    stream does with free credits (one layer of one 16-block chunk each)."""
    from shared.kv import wire

    if kind == "whole":
        return wire.plan(n, kv, max_bytes)
    out = []
    for b0 in range(0, n, 16):
        for layer in range(kv.shape[0]):
            out.append(wire.Piece(len(out), b0, min(n, b0 + 16), layer, layer + 1))
    return out


async def send_once(tx, kv, n: int, kind: str, window: int) -> tuple[float, int, int]:
    """(seconds, bytes, writes) for one prompt's KV through KvSender.write."""
    from services.prefill.ledger import WriteLedger
    from services.prefill.sender import KvSender

    led = WriteLedger()
    led.open("bench", "a", "bench_d0")
    led.granted("a")
    snd = KvSender(tx, "bench_p0", window, led)
    job, eng, credits, errors = _job(n), _Engine(kv, range(n)), asyncio.Semaphore(window), []
    ps = pieces(kind, n, kv, tx.max_payload)

    async def one(p):
        async with credits:
            return await snd.write(job, eng, "a", list(range(n)), p, errors)

    t = time.perf_counter()
    sent = await asyncio.gather(*(one(p) for p in ps))
    el = time.perf_counter() - t
    if errors:
        raise RuntimeError(errors[:3])
    return el, sum(sent), len(ps)


async def run(args) -> dict:
    from shared.kv.nats_transport import NatsKvTransport
    from shared.kv.shm_transport import ShmKvTransport
    from shared.service import ServiceRuntime

    n = -(-args.tokens // SMOLLM2["block_size"])
    proc, url, tmp = start_nats()
    recv = subprocess.Popen([sys.executable, "-m", "pdmesh.bench.kv", "--receiver",
                             "--nats-url", url, "--blocks", str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rt = None
    try:
        assert recv.stdout.readline().strip() == "ready"
        rt = ServiceRuntime("prefill", "bench_p0", url)
        await rt.start()
        nats_tx = NatsKvTransport(rt, timeout_s=60)
        shm_tx = await ShmKvTransport.create(NatsKvTransport(rt, timeout_s=60),
                                             size_bytes=256 << 20)
        shm_tx.hosts["bench_d0"] = shm_tx.host
        kv = pool(n, random=True)
        res = {"tokens": args.tokens, "blocks": n, "window": args.window, "reps": args.reps,
               "shape": SMOLLM2, "dtype": "bfloat16", "runs": {}}
        for kind in ("whole", "stream"):
            for name, tx in (("nats", nats_tx), ("shm", shm_tx)):
                await send_once(tx, kv, n, kind, args.window)            # warm-up
                reps = [await send_once(tx, kv, n, kind, args.window) for _ in range(args.reps)]
                sec = statistics.median(r[0] for r in reps)
                nbytes, writes = reps[0][1], reps[0][2]
                res["runs"][f"{name}_{kind}"] = {
                    "seconds": sec, "bytes": nbytes, "writes": writes,
                    "mean_write_bytes": nbytes / writes, "bytes_per_s": nbytes / sec,
                    "reps_s": [r[0] for r in reps]}
                log(f"{name} {kind}: {nbytes / 1e6:.1f} MB in {writes} writes, "
                    f"{sec * 1e3:.1f} ms ({nbytes / sec / 1e9:.2f} GB/s)")
        assert shm_tx.counters["kv_shm_fallbacks"] == 0
        sizes = sorted({round(r["mean_write_bytes"]) for r in res["runs"].values()})
        raw = await raw_baseline(url, sizes, [args.window], args.raw_mb * 1e6, args.raw_max_s)
        res["raw_nats"] = raw
        for k, r in res["runs"].items():
            base = next(x for x in raw if x["payload_bytes"] == round(r["mean_write_bytes"]))
            r["raw_bytes_per_s"] = base["bytes_per_s"]
            r["vs_raw"] = r["bytes_per_s"] / base["bytes_per_s"]
        res["ratios"] = {f"{k}_vs_raw_nats": r["vs_raw"] for k, r in res["runs"].items()} | {
            f"shm_vs_nats_{kind}": res["runs"][f"shm_{kind}"]["bytes_per_s"]
            / res["runs"][f"nats_{kind}"]["bytes_per_s"] for kind in ("whole", "stream")}
        await shm_tx.close()
        return res
    finally:
        if rt is not None:
            await rt.close()
        recv.stdin.close()
        recv.wait(10)
        proc.terminate()
        proc.wait(10)


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = list(res["runs"])
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [res["runs"][n]["bytes_per_s"] / 1e9 for n in names], 0.4,
           label="pdmesh KvSender (gather, checksum, ack, scatter)")
    ax.bar([x + 0.2 for x in xs], [res["runs"][n]["raw_bytes_per_s"] / 1e9 for n in names],
           0.4, label="raw nats-py request, same size and window")
    ax.set_xticks(list(xs), [f"{n}\n{res['runs'][n]['mean_write_bytes'] / 1024:.0f} KiB/write"
                             for n in names])
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.set_title(f"KV transfer, one {res['tokens']}-token prompt (SmolLM2 shape, bf16, "
                 f"window {res['window']})")
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.bench.kv", description=__doc__)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--raw-mb", type=float, default=96.0)
    ap.add_argument("--raw-max-s", type=float, default=20.0)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nats-url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)      # as the services run (one torch thread each)
    if args.receiver:
        return asyncio.run(receiver_main(args.nats_url, args.blocks))
    res = asyncio.run(run(args))
    save(res, args.out, "kv_transfer", plot)
    log(json.dumps(res["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
