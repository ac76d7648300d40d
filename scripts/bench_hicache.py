"""Coding-agent workload against HiCache: multi-turn sessions whose context grows by
appending (each turn = the previous prompt + the model's answer + new tool output),
several sessions interleaved. Three meshes run side by side in one run, and every turn
goes to each of them back to back, so machine noise hits them alike:

  off        no prefix cache anywhere (prefill and decode pools, no kvstore)
  l1         engine pools only (prefill + decode L1), no kvstore
  l1+l2+l3   engine pools + kvstore host memory + kvstore disk

Engine pools are sized like GPU memory (small: about two sessions' contexts), kvstore
like host memory and disk (large). Writes docs/bench/hicache_<model>.json and .png:
TTFT per turn, prompt tokens computed, and one layer-wise load's timeline (when each
layer landed vs when compute reached it).

    .venv/bin/python scripts/bench_hicache.py [--sessions 6 --turns 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from pdmesh.bench.agentload import run_turns
from pdmesh.local.cluster import Cluster
from shared import micro
from shared.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


CONFIGS = {
    "off": dict(l1=False, kvstore=False),
    "l1": dict(l1=True, kvstore=False),
    "l1+l2+l3": dict(l1=True, kvstore=True),
}


def mesh(model: str, l1: bool, kvstore: bool, pool_mb: int) -> Cluster:
    eng = {"prefix_cache": l1, "kv_cache_mb": pool_mb, "max_num_batched_tokens": 512,
           "chunk_size": 512}
    ov = {"decode": dict(eng), "prefill": eng | {"kvstore": kvstore}}
    return Cluster(model, prefill=1, decode=1, dtype="float32", threads=1, kvstore=kvstore,
                   overrides=ov, echo=False)


async def stats(nats_url: str, service: str) -> dict:
    """The first answering instance's $SRV.STATS data (one instance per service here)."""
    found = await micro.service_stats(nats_url, service, wait_s=2, expect=1)
    if not found:
        raise RuntimeError(f"no {service} instance answered $SRV.STATS")
    return found[0]


def summarize(res: dict, turns: int) -> dict:
    out = {}
    for name, sess in res.items():
        per_turn = []
        for t in range(turns):
            rows = [s[t] for s in sess]
            per_turn.append({
                "ttft_ms_mean": statistics.mean(r["ttft_s"] for r in rows) * 1e3,
                "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
                "cached_fraction_mean": statistics.mean(r["cached_tokens"] / r["prompt_tokens"] for r in rows)})
        rows = [r for s in sess for r in s]
        out[name] = {"per_turn": per_turn,
                     "prefill_tokens_computed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
                     "prompt_tokens": sum(r["prompt_tokens"] for r in rows)}
    # turns with >= 90% of the prompt cached (in the full-cache mesh), vs the same turns uncached
    pairs = [(res["off"][si][t]["ttft_s"], res["l1+l2+l3"][si][t]["ttft_s"])
             for si in range(len(res["off"])) for t in range(turns)
             if res["l1+l2+l3"][si][t]["cached_tokens"] >= 0.9 * res["l1+l2+l3"][si][t]["prompt_tokens"]]
    if pairs:
        out["ge90_cached"] = {"requests": len(pairs),
                              "ttft_ms_off": statistics.mean(a for a, _ in pairs) * 1e3,
                              "ttft_ms_cached": statistics.mean(b for _, b in pairs) * 1e3,
                              "speedup": statistics.mean(a for a, _ in pairs) / statistics.mean(b for _, b in pairs)}
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    for name, s in doc["summary"].items():
        if name == "ge90_cached":
            continue
        xs = range(1, len(s["per_turn"]) + 1)
        ax[0].plot(xs, [t["ttft_ms_mean"] for t in s["per_turn"]], "o-", label=name)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("turn")
    ax[0].set_ylabel("TTFT ms (mean over sessions)")
    ax[0].set_title("TTFT per turn")
    ax[0].legend()
    ax[0].grid(alpha=.3)
    names = [n for n in doc["summary"] if n != "ge90_cached"]
    vals = [doc["summary"][n]["prefill_tokens_computed"] for n in names]
    bars = ax[1].bar(names, vals, color=["tab:gray", "tab:orange", "tab:green"])
    ax[1].bar_label(bars)
    ax[1].set_title("prompt tokens computed by prefill (all turns)")
    tl = doc.get("load_timeline") or {}
    ready = tl.get("layers_ready_s") or []
    waits = tl.get("compute_waits_s") or []
    for layer, t in enumerate(ready):
        ax[2].barh(layer, t * 1e3, color="tab:blue", alpha=.5, label="layer loaded" if layer == 0 else None)
    seen = set()
    for layer, a, b in waits:
        if layer in seen:
            continue
        seen.add(layer)
        ax[2].plot([a * 1e3, b * 1e3], [layer, layer], "r|-", ms=12,
                   label="compute reached layer -> may read" if layer == 0 else None)
    ax[2].set_xlabel("ms since the load started")
    ax[2].set_ylabel("layer")
    ax[2].set_title("one L2 load: layers land while compute runs")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--start-tokens", type=int, default=1536)
    ap.add_argument("--append-tokens", type=int, default=288)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pool-mb", type=int, default=24, help="engine KV pool (L1) per service")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(args.model)
    meshes = {}
    try:
        for name, c in CONFIGS.items():
            print(f"starting mesh '{name}' ...", flush=True)
            meshes[name] = mesh(args.model, c["l1"], c["kvstore"], args.pool_mb).start()
        res, _ = asyncio.run(run_turns(args, meshes, tok, follow="off"))
        timeline = asyncio.run(stats(meshes["l1+l2+l3"].nats_url, "prefill")).get("last_load")
        kv = asyncio.run(stats(meshes["l1+l2+l3"].nats_url, "kvstore"))
    finally:
        for m in meshes.values():
            m.stop()
    doc = {"model": Path(args.model).name, "args": vars(args), "summary": summarize(res, args.turns),
           "load_timeline": timeline, "kvstore": kv, "raw": res}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"hicache_{Path(args.model).name}"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / f"{name}.png")
    s = doc["summary"]
    for n in CONFIGS:
        print(f"{n:9s} prefill tokens computed {s[n]['prefill_tokens_computed']:7d} of "
              f"{s[n]['prompt_tokens']}")
    if "ge90_cached" in s:
        g = s["ge90_cached"]
        print(f">=90% cached turns ({g['requests']}): TTFT {g['ttft_ms_off']:.0f} ms off -> "
              f"{g['ttft_ms_cached']:.0f} ms cached = {g['speedup']:.1f}x")
    print(f"wrote {out / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
