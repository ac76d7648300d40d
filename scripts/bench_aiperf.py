"""pdmesh and llama.cpp's llama-server, measured by NVIDIA's aiperf (a standard client
that knows nothing of pdmesh), on the same SmolLM2-135M-Instruct GGUF, one after the other.

Each server runs alone. On 2 cores the client competes with the server (aiperf's own
services used ~0.7 of a core in a first, unpinned run), so each gets its core budget:
the server is pinned to --server-cpus (default core 0: llama-server -t 1, and pdmesh up's
thread plan sees one core), aiperf to --client-cpus (core 1) with its lightest settings
(one worker, one record processor, no UI, no server-metrics or GPU telemetry); its CPU
seconds are recorded per run. --server-cpus "" --client-cpus "" runs them unpinned. Synthetic
chat prompts of 128 tokens (seeded), 64 output tokens (ignore_eos), greedy, streamed, at
concurrency 1, 4 and 16. aiperf installs from PyPI into a venv of its own (its pins clash
with the project's):

    python3 -m venv /work/aiperf-venv && /work/aiperf-venv/bin/pip install aiperf
    python scripts/bench_aiperf.py --aiperf /work/aiperf-venv/bin/aiperf \
        --llama-server PATH/llama-server            # built as scripts/bench_llamacpp.py says

pdmesh runs as `pdmesh up` starts it (its defaults). Writes <out>/aiperf.json and .png,
and keeps each run's aiperf artifacts under <out>/aiperf_runs/ (not committed).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pdmesh.bench.http import wait_http
from pdmesh.bench.report import save

ROOT = Path(__file__).resolve().parents[1]
LEVELS = {1: 8, 4: 24, 16: 48}      # concurrency -> requests
METRICS = ("output_token_throughput", "time_to_first_token", "inter_token_latency",
           "request_latency", "request_throughput")


def log(msg: str) -> None:
    print(f"[aiperf {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def aiperf_argv(aiperf: str, url: str, model: str, tokenizer: str, c: int, n: int,
                artifacts: Path) -> list[str]:
    """The aiperf command for one level (docs/bench/README.md shows it)."""
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", tokenizer, "--concurrency", str(c),
            "--request-count", str(n), "--warmup-request-count", "2",
            "--prompt-input-tokens-mean", "128", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "64", "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--random-seed", "0", "--ui", "none", "--workers-max", "1",
            "--record-processor-service-count", "1", "--no-server-metrics",
            "--no-gpu-telemetry", "--artifact-dir", str(artifacts)]


def summary(artifacts: Path) -> dict:
    """aiperf's own aggregate numbers (profile_export_aiperf.json) for the metrics above."""
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"no profile_export_aiperf.json under {artifacts}")
    data = json.loads(found[-1].read_text())
    out = {}
    for m in METRICS:
        v = data.get(m) or next((x for x in data.get("records", []) if x.get("tag") == m), None)
        if isinstance(v, dict):
            out[m] = {k: v[k] for k in ("unit", "avg", "p50", "p90", "p99") if k in v}
    for k in ("error_request_count", "request_count"):
        v = data.get(k)
        out[k] = v.get("avg") if isinstance(v, dict) else v
    return out


def pinned(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def run_level(args, name: str, url: str, model: str, c: int, n: int) -> dict:
    artifacts = Path(args.out) / "aiperf_runs" / f"{name}_c{c}"
    shutil.rmtree(artifacts, ignore_errors=True)
    argv = pinned(args.client_cpus) + aiperf_argv(args.aiperf, url, model, args.tokenizer, c,
                                                  n, artifacts)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"aiperf failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    r = summary(artifacts)
    r["client_cpu_s"] = round((after.ru_utime + after.ru_stime)
                              - (before.ru_utime + before.ru_stime), 2)
    r["client_wall_s"] = round(wall, 2)
    return r



def servers(args) -> list[tuple[str, list[str], str, str, str]]:
    """(name, argv, url, model name, readiness path)."""
    out, pin = [], pinned(args.server_cpus)
    threads = len(os.sched_getaffinity(0)) if not args.server_cpus else len(
        [c for part in args.server_cpus.split(",") for c in _cpus(part)])
    if args.llama_server:
        out.append(("llama-server", pin + [args.llama_server, "-m", args.gguf, "--port", "8081",
                                           "-np", "16", "-c", "16384", "-t", str(threads)],
                    "http://127.0.0.1:8081", "smollm2", "/v1/models"))
    out.append(("pdmesh", pin + [sys.executable, "-m", "pdmesh.cli", "up", "--port", "8083",
                                 *args.pdmesh_flags.split()],
                "http://127.0.0.1:8083", "SmolLM2-135M-Instruct", "/ready"))
    return out


def _cpus(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["servers"])
    panels = (("output_token_throughput", "avg", 1, "output tokens/s"),
              ("time_to_first_token", "p50", 1, "TTFT p50 (ms)"),
              ("inter_token_latency", "p50", 1, "ITL p50 (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, stat, scale, label) in zip(axes, panels):
        for j, n in enumerate(names):
            lv = res["servers"][n]
            xs = [i + (j - (len(names) - 1) / 2) * 0.8 / len(names) for i in range(len(lv))]
            ys = [(lv[c].get(metric) or {}).get(stat) or 0 for c in lv]
            b = ax.bar(xs, [y * scale for y in ys], 0.8 / len(names), label=n)
            ax.bar_label(b, [f"{y:.0f}" if y >= 10 else f"{y:.1f}" for y in ys], fontsize=7)
        ax.set_xticks(range(len(LEVELS)), [f"c={c}" for c in LEVELS])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("aiperf against pdmesh and llama-server: SmolLM2-135M-Instruct, 128 in / "
                 "64 out, greedy, streamed")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    from shared.engine.gguf_convert import default_model_dir, find_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf executable")
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--gguf", default="")
    ap.add_argument("--tokenizer", default=str(default_model_dir()),
                    help="a local tokenizer folder (no hub)")
    ap.add_argument("--server-cpus", default="0", help="taskset list for the server")
    ap.add_argument("--client-cpus", default="1", help="taskset list for aiperf")
    ap.add_argument("--pdmesh-flags", default="", help="pdmesh up's flags (default: none)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    args.gguf = args.gguf or str(find_gguf())
    res = {"client": "aiperf", "gguf": os.path.basename(args.gguf), "levels": LEVELS,
           "input_tokens": 128, "output_tokens": 64, "cpus": os.cpu_count(),
           "server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
           "commands": {}, "servers": {}}
    out = Path(args.out)
    runs = out / "aiperf_runs"
    runs.mkdir(parents=True, exist_ok=True)
    for name, argv, url, model, ready in servers(args):
        log(" ".join(argv))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                stdout=open(runs / f"{name}.log", "w"))
        try:
            wait_http(url, ready)
            res["commands"][name] = {"server": " ".join(argv).replace(sys.executable,
                                                                      "python"),
                                     "aiperf": " ".join(pinned(args.client_cpus) + aiperf_argv(
                                         "aiperf", url, model, "TOKENIZER", 1, LEVELS[1],
                                         Path("OUT")))}
            res["servers"][name] = {}
            for c, n in LEVELS.items():
                r = run_level(args, name, url, model, c, n)
                res["servers"][name][c] = r
                log(f"{name} c={c}: {r['output_token_throughput']['avg']:.1f} tok/s, TTFT p50 "
                    f"{r['time_to_first_token']['p50']:.0f} ms, ITL p50 "
                    f"{r['inter_token_latency']['p50']:.1f} ms, errors "
                    f"{r.get('error_request_count')}, client {r['client_cpu_s']} CPU s")
        finally:
            proc.terminate()
            proc.wait(60)
    if len(res["servers"]) == 2:
        a, b = res["servers"]["pdmesh"], res["servers"]["llama-server"]
        res["pdmesh_over_llama_server"] = {
            c: {"output_tok_s": a[c]["output_token_throughput"]["avg"]
                / b[c]["output_token_throughput"]["avg"],
                "ttft_p50": a[c]["time_to_first_token"]["p50"]
                / b[c]["time_to_first_token"]["p50"],
                "itl_p50": a[c]["inter_token_latency"]["p50"]
                / b[c]["inter_token_latency"]["p50"]} for c in LEVELS}
        log(f"pdmesh / llama-server: {json.dumps(res['pdmesh_over_llama_server'])}")
    save(res, out, "aiperf", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
