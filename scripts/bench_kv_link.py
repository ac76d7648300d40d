"""KV across a real link (issue 30): PD vs colocated time to first token when decode is on
another host, for long prompts, per link rate, whole-prompt KV vs layer-wise streaming.

`pdmesh up` (SmolLM2, its defaults) on this host: the gateway, nats, kvstore, prefill-0
(whole-prompt KV, the default) and prefill_s (the same with --kv-stream). decode_b runs on
a network-lab host (pdmesh/netlab.py) behind a veth link limited by a token bucket (tc
tbf) to each rate; decode-0 is stopped (SIGSTOP) so that every request goes to decode_b,
and one prefill is stopped while the other is measured. For each link and prompt length,
requests alternate colocated (decode_b computes the prompt itself) / PD whole / PD
streamed, each a distinct random prompt (no cache hit), 2 output tokens, c=1.

Reported per cell: TTFT medians, PD / colocated, and the KV transfer as a share of PD's
TTFT (Mooncake's table) estimated as (PD TTFT - colocated TTFT) / PD TTFT, with the KV
bytes (layers x 2 x kv heads x head dim x 2 bytes x tokens) over the link rate as the
floor. Link delay needs sch_netem, which this kernel lacks (netlab.netem_reason()): the
rows are at the veth's own RTT (~0.05 ms).

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from pdmesh import netlab  # noqa: E402
from pdmesh.launched import UpMesh  # noqa: E402
from pdmesh.loadgen import completion_body, stream_one  # noqa: E402


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


async def main_async(a) -> dict:
    from shared.engine.gguf_convert import default_model_dir

    model = Path(a.model) if a.model else default_model_dir()
    rows = []
    with netlab.NetLab() as nl:
        async with UpMesh(*(["--model", str(model)] if a.model else []), "--nats-host",
                          "0.0.0.0", "--no-enable-prefix-caching", "--no-kvstore",
                          start_timeout_s=600) as m:
            host = nl.host("b")
            decode_b = m.spawn_like("decode-0", "decode_b", nats_host=host.peer,
                                    wrap=host.command)
            stream = m.spawn_like("prefill-0", "prefill_s", extra=["--kv-stream"])
            procs = {"whole": m.pid("prefill-0"), "stream": stream.pid}
            try:
                os.kill(m.pid("decode-0"), signal.SIGSTOP)      # every request: decode_b
                await until_only(m, 1, 120)
                served = m.record().get("model") or str(model)
                name = Path(served).name
                rng = random.Random(0)
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
                    for rate in a.rates.split(","):
                        host.heal()
                        if rate != "none":
                            host.shape(rate=rate)
                        for tokens in (int(t) for t in a.tokens.split(",")):
                            res: dict[str, list[float]] = {"colocated": [], "whole": [],
                                                           "stream": []}
                            for i in range(a.n + 1):          # the first round warms up
                                for path in ("colocated", "whole", "stream"):
                                    if path != "colocated":
                                        other = procs["stream" if path == "whole" else "whole"]
                                        os.kill(other, signal.SIGSTOP)
                                        os.kill(procs[path], signal.SIGCONT)
                                        # a stopped prefill's pull request expires (1 s): no
                                        # job is handed to it
                                        await asyncio.sleep(1.5)
                                    prompt = [rng.randrange(200, 40000) for _ in range(tokens)]
                                    body = completion_body(name, prompt, "colocated"
                                                           if path == "colocated" else "pd", 2)
                                    r = await stream_one(http, m.url, body)
                                    if i:
                                        res[path].append(r["ttft_s"])
                                    log(f"{rate} {tokens} {path}: TTFT {r['ttft_s']:.3f} s")
                            for p in procs.values():
                                os.kill(p, signal.SIGCONT)
                            med = {k: statistics.median(v) for k, v in res.items()}
                            nbytes = kv_bytes(model, tokens)
                            wire = nbytes * 8 / rate_bps(rate) if rate != "none" else 0.0
                            row = {"link": rate, "prompt_tokens": tokens, "kv_bytes": nbytes,
                                   "ttft_colocated_s": round(med["colocated"], 3),
                                   "ttft_pd_whole_s": round(med["whole"], 3),
                                   "ttft_pd_stream_s": round(med["stream"], 3),
                                   "pd_whole_over_colocated": round(med["whole"] / med["colocated"], 3),
                                   "pd_stream_over_colocated": round(med["stream"] / med["colocated"], 3),
                                   "wire_floor_s": round(wire, 3),
                                   "kv_share_of_ttft_whole": round(max(0.0, med["whole"] - med["colocated"]) / med["whole"], 3),
                                   "kv_share_of_ttft_stream": round(max(0.0, med["stream"] - med["colocated"]) / med["stream"], 3),
                                   "link_use_whole": round(wire / max(1e-9, med["whole"] - med["colocated"]), 3) if wire else None,
                                   "faster": min(("colocated", "whole", "stream"), key=med.get),
                                   "samples": res}
                            rows.append(row)
                            log(json.dumps({k: v for k, v in row.items() if k != "samples"}))
            finally:
                for p in (m.pid("decode-0"), *procs.values()):
                    try:
                        os.kill(p, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                host.heal()
                for p in (decode_b, stream):
                    p.kill()
                    p.wait()
    return {"model": str(model), "netem": netlab.netem_reason() or "available", "rows": rows}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['link']}\n{r['prompt_tokens']} tok" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.27
    for k, (key, name) in enumerate((("ttft_colocated_s", "colocated"),
                                     ("ttft_pd_whole_s", "PD, whole-prompt KV"),
                                     ("ttft_pd_stream_s", "PD, layer-wise streamed"))):
        bars = ax.bar([i + (k - 1) * w for i in x], [r[key] for r in rows], w, label=name)
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
