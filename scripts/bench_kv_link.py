"""KV across a real link (issue 30): PD vs colocated time to first token when decode is on
another host, for long prompts, per link rate: whole-prompt KV, layer-wise streaming, and
the default (kv_stream auto, which picks one per job from the link it measured).

`pdmesh up` (SmolLM2, its defaults) on this host: the gateway, nats, prefill-0 (the
default: auto), prefill_whole (--kv-stream off) and prefill_stream (--kv-stream on).
decode_b runs on a network-lab host (pdmesh/chaos/netlab.py) behind a veth link limited by a
token bucket (tc tbf) to each rate; decode-0 is stopped (SIGSTOP) so that every request
goes to decode_b, and only the prefill being measured runs. For each link and prompt
length, requests alternate colocated (decode_b computes the prompt itself) / PD auto / PD
whole / PD streamed, each a distinct random prompt (no cache hit), 2 output tokens, c=1.

Reported per cell: TTFT medians, PD / colocated, the KV transfer as a share of PD's TTFT
(Mooncake's table: (PD TTFT - colocated TTFT) / PD TTFT), the whole path's KV bytes/s
after the compute as a share of the link rate, and what auto picked and why (prefill-0's
STATS: the link rate it measured, wire time against compute time). Link delay needs
sch_netem, which this kernel lacks (netlab.netem_reason()): the rows are at the veth's own
RTT (~0.05 ms).

    sudo python scripts/bench_kv_link.py [--tokens 2000,8000] [--rates 1gbit,10gbit] [--n 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from pdmesh.bench.loadgen import completion_body, stream_one
from pdmesh.chaos import netlab
from pdmesh.local.launched import UpMesh
from shared import micro

ROOT = Path(__file__).resolve().parents[1]




def log(msg: str) -> None:
    print(f"[kv-link {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kv_bytes(model_dir: Path, tokens: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * dim * 2 * tokens


def rate_bps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    raise ValueError(rate)


async def until_only(m: UpMesh, decodes: int, timeout_s: float = 60) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout_s:
            async with http.get(m.url + "/ready") as r:
                if (await r.json()).get("decode_instances") == decodes:
                    return
            await asyncio.sleep(0.3)
    raise TimeoutError(f"not {decodes} decode instance(s)")


PD_PATHS = ("auto", "whole", "stream")


async def measure(m: UpMesh, nc, http, procs: dict, path: str, name: str, prompt) -> dict:
    """One c=1 request down `path`; with the prefill's STATS around it."""
    if path != "colocated":
        for other, pid in procs.items():
            os.kill(pid, signal.SIGCONT if other == path else signal.SIGSTOP)
        # a stopped prefill's pull request expires (1 s): no job is handed to it
        await asyncio.sleep(1.5)
    body = completion_body(name, prompt, "colocated" if path == "colocated" else "pd", 2)
    before = await micro.total_stats(nc, "prefill", 0.3)
    r = await stream_one(http, m.url, body)
    after = await micro.service_stats(nc, "prefill", 0.3)    # only `path`'s prefill runs
    moved = {k: micro.sum_stats(after).get(k, 0) - before.get(k, 0)
             for k in ("kv_bytes", "kv_transfer_s")}
    st = after[0] if len(after) == 1 else {}
    return {"ttft_s": r["ttft_s"], **moved,
            "choice": st.get("kv_stream_choice", {}).get("decode_b"),
            "link_bytes_per_s": st.get("kv_link_bytes_per_s", {}).get("decode_b")}


def row_of(rate: str, tokens: int, model: Path, res: dict[str, list[dict]]) -> dict:
    med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in res.items()}
    nbytes = kv_bytes(model, tokens)
    link = rate_bps(rate) / 8 if rate != "none" else None
    # the whole path's KV transfer starts after the compute: its bytes / seconds is the
    # KV throughput over the link
    whole_bps = statistics.median(x["kv_bytes"] / x["kv_transfer_s"] for x in res["whole"]
                                  if x["kv_transfer_s"] > 0)
    auto = res["auto"][-1]
    return {"link": rate, "prompt_tokens": tokens, "kv_bytes": nbytes,
            **{f"ttft_{k}_s": round(v, 3) for k, v in med.items()},
            **{f"{k}_over_colocated": round(med[k] / med["colocated"], 3) for k in PD_PATHS},
            "wire_floor_s": round(nbytes / link, 3) if link else None,
            "whole_transfer_s": round(statistics.median(x["kv_transfer_s"] for x in res["whole"]), 3),
            "whole_kv_bytes_per_s": round(whole_bps),
            "link_use_whole": round(whole_bps / link, 3) if link else None,
            "kv_share_of_ttft_whole": round(max(0.0, med["whole"] - med["colocated"]) / med["whole"], 3),
            "kv_share_of_ttft_stream": round(max(0.0, med["stream"] - med["colocated"]) / med["stream"], 3),
            "auto_measured_bytes_per_s": auto["link_bytes_per_s"],
            "auto_picks": (auto["choice"] or "?").split(" ")[0],
            "auto_why": auto["choice"],
            "faster_pd": min(("whole", "stream"), key=med.get),
            "samples": res}


async def main_async(a) -> dict:
    from shared.engine.gguf_convert import default_model_dir

    model = Path(a.model) if a.model else default_model_dir()
    rows = []
    with netlab.NetLab() as nl:
        async with UpMesh(*(["--model", str(model)] if a.model else []), "--nats-host",
                          "0.0.0.0", "--no-enable-prefix-caching", "--no-kvstore",
                          *(f for kv in a.set for f in ("--set", kv)),
                          start_timeout_s=600) as m:
            host = nl.host("b")
            decode_b = m.spawn_like("decode-0", "decode_b", nats_host=host.peer,
                                    wrap=host.command)
            # two prefills pin each path; for each link a fresh one runs the default
            # (kv_stream auto: it measures the link itself); prefill-0 stays stopped
            pinned = {k: m.spawn_like("prefill-0", f"prefill_{k}", extra=["--kv-stream", v])
                      for k, v in (("whole", "off"), ("stream", "on"))}
            procs = {k: p.pid for k, p in pinned.items()}
            os.kill(m.pid("prefill-0"), signal.SIGSTOP)
            try:
                await until_only(m, 2, 300)                     # decode_b has joined
                os.kill(m.pid("decode-0"), signal.SIGSTOP)      # every request: decode_b
                await until_only(m, 1, 120)
                name = Path(m.record().get("model") or str(model)).name
                rng = random.Random(0)
                nc = await m.nats()
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
                    for rate in a.rates.split(","):
                        host.heal()
                        if rate != "none":
                            host.shape(rate=rate)
                        auto = m.spawn_like("prefill-0", f"prefill_auto_{rate}")
                        pinned[f"auto_{rate}"] = auto
                        procs["auto"] = auto.pid
                        await asyncio.sleep(20)                 # its model loaded
                        for tokens in (int(t) for t in a.tokens.split(",")):
                            res: dict[str, list[dict]] = {p: [] for p in ("colocated", *PD_PATHS)}
                            for i in range(a.n + 1):          # the first round warms up
                                for path in res:
                                    prompt = [rng.randrange(200, 40000) for _ in range(tokens)]
                                    x = await measure(m, nc, http, procs, path, name, prompt)
                                    if i:
                                        res[path].append(x)
                                    log(f"{rate} {tokens} {path}: TTFT {x['ttft_s']:.3f} s, KV "
                                        f"{x['kv_bytes'] / 1e6:.1f} MB, {x['kv_transfer_s']:.3f} s "
                                        f"after the compute; {x['choice'] or ''}")
                            for pid in procs.values():
                                os.kill(pid, signal.SIGCONT)
                            row = row_of(rate, tokens, model, res)
                            rows.append(row)
                            log(json.dumps({k: v for k, v in row.items() if k != "samples"}))
                        auto.kill()
                        auto.wait()
                await nc.close()
            finally:
                for pid in (m.pid("decode-0"), m.pid("prefill-0"), *procs.values()):
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                host.heal()
                for p in (decode_b, *pinned.values()):
                    p.kill()
                    p.wait()
    return {"model": str(model), "netem": netlab.netem_reason() or "available", "rows": rows}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['link']}, {r['prompt_tokens']} tok\nauto: {r['auto_picks']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.2
    for k, (key, name) in enumerate((("ttft_colocated_s", "colocated"),
                                     ("ttft_whole_s", "PD, whole-prompt KV"),
                                     ("ttft_stream_s", "PD, layer-wise streamed"),
                                     ("ttft_auto_s", "PD, the default (auto)"))):
        bars = ax.bar([i + (k - 1.5) * w for i in x], [r[key] for r in rows], w, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("TTFT (s), median, c=1")
    ax.set_title("KV across a link: decode on another host (network lab, tc tbf rate)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--tokens", default="2000,8000")
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="SERVICE.FIELD=V",
                    help="passed to pdmesh up")
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    a = ap.parse_args()
    why = netlab.reason()
    if why:
        print(f"bench_kv_link: no network lab here: {why}", file=sys.stderr)
        return 2
    res = asyncio.run(main_async(a))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_link.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "kv_link.png")
    for r in res["rows"]:
        print({k: v for k, v in r.items() if k != "samples"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
