"""LayerSplit vs independent prefill ranks on a coding-agent workload (issue 15).

Multi-turn sessions whose context grows by appending (each turn = the previous prompt +
the model's answer + new tool output), sessions interleaved round-robin; jobs go to
whichever prefill pulls them first (the JetStream work queue, no session affinity). Two
meshes run side by side, every turn sent to each back to back:

  independent  2 prefill ranks, each with its own prefix store holding every layer
               (a 1-rank group: the unsplit layout) of --cache-mb bytes
  layersplit   the same 2 ranks as one LayerSplit group: each store (--cache-mb bytes,
               the same per rank) holds only the rank's layers of the group's prefixes

Prefill's engine L1 and kvstore are off in both, so the store is the only prefix cache
and the comparison is the layout alone. Writes docs/bench/layersplit_<model>.json and .png:
hit rate and TTFT per turn against the working set (every session's context), prefill
tokens computed, the share of transfer time hidden behind compute, per-rank store bytes.

    .venv/bin/python scripts/bench_layersplit.py [--sessions 6 --turns 8 --cache-mb 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from pdmesh.bench.agentload import run_turns
from pdmesh.local.cluster import Cluster
from shared import micro
from shared.engine.loader import load_config
from shared.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent



def mesh(model: str, group: bool, cache_mb: float, pool_mb: int) -> Cluster:
    eng = {"prefix_cache": False, "kv_cache_mb": pool_mb, "max_num_batched_tokens": 512,
           "chunk_size": 512}
    pre = eng | {"kvstore": False, "group_cache_mb": cache_mb}
    if not group:
        pre |= {"group_size": 1}
    return Cluster(model, prefill=2, prefill_group=2 if group else 0, decode=1, dtype="float32",
                   threads=1, kvstore=False, overrides={"decode": dict(eng), "prefill": pre},
                   echo=False)


async def prefill_stats(url: str) -> list[dict]:
    return await micro.service_stats(url, "prefill", wait_s=2, expect=2)


async def wait_groups(meshes: dict[str, Cluster], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for m in meshes.values():
        while sum(bool(s.get("group_ready")) for s in await prefill_stats(m.nats_url)) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("group did not form")
            await asyncio.sleep(0.5)


def summarize(res: dict, turns: int) -> dict:
    out = {}
    for name, sess in res.items():
        per_turn = []
        for t in range(turns):
            rows = [s[t] for s in sess]
            per_turn.append({
                "ttft_ms_mean": statistics.mean(r["ttft_s"] for r in rows) * 1e3,
                "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
                "hit_rate": sum(r["cached_tokens"] for r in rows)
                / sum(r["prompt_tokens"] for r in rows)})
        rows = [r for s in sess for r in s]
        out[name] = {"per_turn": per_turn,
                     "hit_rate": sum(r["cached_tokens"] for r in rows)
                     / sum(r["prompt_tokens"] for r in rows),
                     "ttft_ms_mean": statistics.mean(r["ttft_s"] for r in rows) * 1e3,
                     "prefill_tokens_computed": sum(r["prompt_tokens"] - r["cached_tokens"]
                                                    for r in rows),
                     "prompt_tokens": sum(r["prompt_tokens"] for r in rows)}
    return out


def group_summary(stats: list[dict]) -> dict:
    keys = ("group_slots", "group_owned_layers", "group_cached_blocks", "group_cached_bytes",
            "group_store_bytes", "group_loads", "group_load_failures", "group_loaded_blocks",
            "group_fetches", "group_sent_bytes", "group_recv_bytes", "group_evictions",
            "group_wait_s", "group_transfer_s", "group_hidden_share", "group_wait_per_layer_s")
    stats = sorted(stats, key=lambda s: (s.get("group_rank", 0), s.get("group_cached_bytes", 0)))
    return {f"rank{i}": {k: s.get(k) for k in keys} for i, s in enumerate(stats)}


def crossover(doc: dict) -> dict:
    """The working set (tokens) one rank's store holds, and the first turn past it."""
    a = doc["args"]
    mc = load_config(a["model"])
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4      # float32 KV
    rank_tokens = int(a["cache_mb"] * (1 << 20) // per_token)
    ws = doc["working_set_tokens"]
    past = next((t + 1 for t, w in enumerate(ws) if w > rank_tokens), None)
    past_group = next((t + 1 for t, w in enumerate(ws) if w > 2 * rank_tokens), None)
    return {"one_rank_budget_tokens": rank_tokens, "group_budget_tokens": 2 * rank_tokens,
            "first_turn_working_set_over_one_rank": past,
            "first_turn_working_set_over_group": past_group}


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4.8))
    ws = [w / 1000 for w in doc["working_set_tokens"]]
    cx = doc["crossover"]
    for name, s in doc["summary"].items():
        ax[0].plot(ws, [t["hit_rate"] for t in s["per_turn"]], "o-", label=name)
        ax[1].plot(ws, [t["ttft_ms_mean"] for t in s["per_turn"]], "o-", label=name)
    for a in ax[:2]:
        a.axvline(cx["one_rank_budget_tokens"] / 1000, color="gray", ls="--",
                  label="one rank's budget")
        a.axvline(cx["group_budget_tokens"] / 1000, color="gray", ls=":",
                  label="group's budget")
        a.set_xlabel("working set (k tokens, all sessions' contexts)")
        a.grid(alpha=.3)
        a.legend(fontsize=7)
    ax[0].set_ylabel("prompt tokens served from the cache")
    ax[0].set_title("hit rate per turn")
    ax[1].set_ylabel("TTFT ms (mean over sessions)")
    ax[1].set_title("TTFT per turn")
    names = list(doc["summary"])
    bars = ax[2].bar(names, [doc["summary"][n]["prefill_tokens_computed"] for n in names],
                     color=["tab:gray", "tab:green"])
    ax[2].bar_label(bars)
    ax[2].set_title("prompt tokens computed by prefill (all turns)")
    g = doc["groups"]["layersplit"]
    for i, (rank, s) in enumerate(sorted(g.items())):
        w = s.get("group_wait_per_layer_s") or []
        ax[3].bar([x + 0.4 * i for x in range(len(w))], [v * 1e3 for v in w], width=0.4,
                  label=f"{rank}: hidden {s.get('group_hidden_share', 0):.0%}")
    ax[3].set_xlabel("layer")
    ax[3].set_ylabel("compute waited (ms, all loads)")
    ax[3].set_title("LayerSplit: time compute waited per layer")
    ax[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--start-tokens", type=int, default=1024)
    ap.add_argument("--append-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cache-mb", type=float, default=32.0, help="prefix store per prefill rank")
    ap.add_argument("--pool-mb", type=int, default=24, help="engine KV pool per service")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(args.model)
    meshes = {"independent": mesh(args.model, False, args.cache_mb, args.pool_mb),
              "layersplit": mesh(args.model, True, args.cache_mb, args.pool_mb)}
    try:
        for m in meshes.values():
            m.start()

        async def go():
            await wait_groups(meshes)
            res, working = await run_turns(args, meshes, tok, follow="independent")
            r = {"results": res, "working_set_tokens": working}
            r["groups"] = {n: group_summary(await prefill_stats(m.nats_url))
                           for n, m in meshes.items()}
            return r

        r = asyncio.run(go())
    finally:
        for m in meshes.values():
            m.stop()
    name = Path(args.model).name
    doc = {"model": name, "args": vars(args), "working_set_tokens": r["working_set_tokens"],
           "summary": summarize(r["results"], args.turns), "groups": r["groups"],
           "raw": r["results"]}
    doc["crossover"] = crossover(doc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"layersplit_{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / f"layersplit_{name}.png")
    print(json.dumps({k: doc[k] for k in ("crossover",)} | {
        n: {k: v for k, v in s.items() if k != "per_turn"} for n, s in doc["summary"].items()},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
