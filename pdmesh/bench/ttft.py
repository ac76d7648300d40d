"""PD vs colocated time to first token at c=1, short (~16-token) and long (~2,000-token)
prompts, for several KV paths of prefill, in one run.

For each configuration a mesh is started (1 prefill, 1 decode, one torch thread each, the
prefix caches off so every prompt is computed), then requests alternate PD / colocated
one by one (machine load drifts hit both alike), each a distinct prompt, streamed, 2
output tokens. Configurations: `before` (the whole prompt's KV over NATS after the
compute), `stream` (layer-wise streaming over NATS, `--kv-stream`), `shm` (the whole
prompt's KV through shared memory), `stream+shm` (layer-wise into shared memory),
`default` (the default settings: on one host, `shm`). Each configuration also times
raw NATS round trips after the colocated TTFT's idle time (floor()): PD's two extra
cross-process hops at their cheapest, the short ratio's floor on this host. Writes
<out>/ttft_<model>.json and .png.

    python -m pdmesh.bench.ttft [--model models/tiny-target] [--short 20] [--long 8]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from pdmesh.bench.loadgen import completion_body, stream_one
from pdmesh.bench.rawnats import idle_round_trips, log
from pdmesh.bench.report import save
from pdmesh.bench.run import LONG_UNIT, PROMPTS

CONFIGS = {
    "before": {"kv_stream": "off", "kv_shm": False},
    "stream": {"kv_stream": "on", "kv_shm": False},
    "shm": {"kv_stream": "off", "kv_shm": True},
    "stream+shm": {"kv_stream": "on", "kv_shm": True, "kv_stream_shm": True},
    "default": {},
}


def long_prompt(i: int, lines: int) -> str:
    unit = LONG_UNIT.splitlines(keepends=True)
    return f"# file {i}: utilities\n" + "".join(unit[j % len(unit)] for j in range(lines))


async def measure(url: str, model: str, prompts: list[str]) -> dict:
    import aiohttp

    out = {"pd": [], "colocated": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for path in ("pd", "colocated"):          # warm-up
            await stream_one(http, url, completion_body(model, prompts[0] + " ", path, 2))
        for i, q in enumerate(prompts):
            order = ("pd", "colocated") if i % 2 == 0 else ("colocated", "pd")
            for path in order:
                r = await stream_one(http, url, completion_body(model, f"{path}: {q}", path, 2))
                if r["path"] != path:
                    raise RuntimeError(f"asked for {path}, served {r['path']}")
                out[path].append((r["ttft_s"], r["prompt_tokens"]))
    return out


def summarize(m: dict) -> dict:
    res = {}
    for path, xs in m.items():
        t = [x[0] for x in xs]
        res[path] = {"ttft_p50_s": statistics.median(t), "ttft_mean_s": statistics.fmean(t),
                     "prompt_tokens": statistics.fmean(x[1] for x in xs), "n": len(t),
                     "ttft_s": t}
    res["ratio_p50"] = res["pd"]["ttft_p50_s"] / res["colocated"]["ttft_p50_s"]
    res["ratio_mean"] = res["pd"]["ttft_mean_s"] / res["colocated"]["ttft_mean_s"]
    return res


def run_config(args, name: str, kv: dict) -> dict:
    from pdmesh.local.cluster import Cluster

    over = {"decode": {"prefix_cache": False},
            "prefill": {"prefix_cache": False, **kv}}
    with Cluster(args.model, prefill=1, decode=1, threads=1, dtype=args.dtype, kvstore=False,
                 overrides=over, echo=False) as c:
        time.sleep(2.0)                     # a decode heartbeat tells prefill decode's host
        short = [f"# request {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(args.short)]
        longs = [long_prompt(i, args.long_lines) for i in range(args.long)]
        model = Path(args.model).name
        res = {"short": summarize(asyncio.run(measure(c.url, model, short))),
               "long": summarize(asyncio.run(measure(c.url, model, longs)))}
        res["hop_floor"] = floor(c.nats_url, res["short"])
    log(f"{name}: short PD/colocated {res['short']['ratio_p50']:.3f} (p50), long "
        f"{res['long']['ratio_p50']:.3f} ({res['long']['pd']['prompt_tokens']:.0f} tokens); "
        f"two idle NATS hops {res['hop_floor']['rtt_p50_s'] * 1e3:.2f} ms: the short ratio's "
        f"floor on this host is {res['hop_floor']['ratio_floor']:.3f}")
    return res


def floor(nats_url: str, short: dict) -> dict:
    """The two hops PD adds, measured on the mesh's nats-server after the colocated
    TTFT's idle time: the short-prompt ratio PD could reach with no processing at all."""
    col = short["colocated"]["ttft_p50_s"]
    f = asyncio.run(idle_round_trips(nats_url, idle_s=col))
    return f | {"ratio_floor": (col + f["rtt_p50_s"]) / col}


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["configs"])
    floors = [(x, c["short"]["colocated"]["ttft_p50_s"] + c["hop_floor"]["rtt_p50_s"])
              for x, c in enumerate(res["configs"].values())
              if "hop_floor" in c]                    # (older results lack it)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("short", "long")):
        for j, path in enumerate(("pd", "colocated")):
            ys = [res["configs"][n][kind][path]["ttft_p50_s"] * 1e3 for n in names]
            bars = ax.bar([x + 0.4 * j - 0.2 for x in range(len(names))], ys, 0.4, label=path)
            if path == "pd":
                ax.bar_label(bars, [f"{res['configs'][n][kind]['ratio_p50']:.2f}x"
                                    for n in names], fontsize=8)
        if kind == "short" and floors:  # what PD's two extra hops alone cost (floor())
            ax.scatter([x - 0.2 for x, _ in floors], [y * 1e3 for _, y in floors], marker="_",
                       s=900, color="k", label="colocated + 2 idle NATS hops", zorder=3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title(f"{kind} prompts, c=1 (label: PD / colocated)")
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.suptitle(f"PD vs colocated TTFT: {res['model']} ({res['dtype']}, 1 thread each)")
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.bench.ttft", description=__doc__)
    ap.add_argument("--model", default="models/tiny-target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--short", type=int, default=20)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-lines", type=int, default=193, help="~2,000 tokens")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    res = {"model": Path(args.model).name, "dtype": args.dtype, "configs": {}}
    for name in args.configs.split(","):
        res["configs"][name] = run_config(args, name, CONFIGS[name])
    path = save(res, args.out, f"ttft_{res['model']}", plot)
    log(f"wrote {path}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
