"""Faults in the `docker compose` cluster (issue 30), in Dynamo's fault-test format: the
image as scripts/image.sh builds it, compose.yaml as it is, scaled to 2 decodes and 2
prefills, each service in its own container on the compose network; a fault is a
`docker kill` of one container (then `docker start`, as its orchestrator would) or a
`docker network disconnect` of one container for N s (then reconnect, with its service's
DNS alias). The product's defaults (int4, the compose environment), with the repo's tiny
model mounted (PDMESH_MODELS) and --deterministic, so that every output can be compared.

    sudo python scripts/compose_faults.py [--scenarios kill_decode,cut_nats_5s,...]

  kill_<service>        docker kill (SIGKILL) one container under 16 streams, start it again
  cut_<service>_<N>s    the container's network unplugged for N s, then plugged back (the
                        gateway's mesh side only: its published port is on a network of its
                        own, so its clients still reach it, as across a real partition)

Each: 32 greedy requests, 16 at a time, 64 tokens. The reference of each prompt is what
an undisturbed run of the same cluster answered (the `none` row runs it twice). A request
fails on an HTTP error, an error event or a lost connection; it is wrong when it completes
with other tokens. recovery: from the start (or reconnect) until the gateway serves a
request and counts 2 decodes. leaked: KV blocks the decodes still hold 30 s after the load
(every instance's $SRV.STATS, asked as the read-only debug user from a container on the
compose network).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from pdmesh.bench.workloads import CODE_PROMPTS
from pdmesh.chaos.faultload import Load
from pdmesh.deploy.creds import api_key
from pdmesh.local.launch import free_port

ROOT = Path(__file__).resolve().parents[1]



MAX_TOKENS = 64
SCENARIOS = ["none", "kill_decode", "kill_prefill", "kill_nats", "kill_kvstore",
             "kill_jobstream", "kill_gateway", "cut_decode_5s", "cut_prefill_5s", "cut_nats_5s",
             "cut_gateway_5s", "cut_decode_30s", "cut_prefill_30s", "cut_nats_30s",
             "cut_gateway_30s"]
OVERRIDE = """\
x-det: &det
  PDMESH_MODEL: /models/host/tiny-target
  PDMESH_DETERMINISTIC: "true"
services:
  prefill: {environment: *det}
  decode: {environment: *det}
  gateway:
    environment: {PDMESH_MODEL: /models/host/tiny-target}
    networks: [a_clients, default]
networks:
  a_clients: {}   # the clients' side: sorts before "default", so the published port is here
"""


def log(msg: str) -> None:
    print(f"[compose-faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(*argv: str, timeout: float = 600, check: bool = True, env=None) -> str:
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr[-2000:]}")
    return r.stdout


class Cluster:
    def __init__(self, workdir: Path):
        self.project = f"pdmfaults{os.getpid()}"
        self.secrets = workdir / "secrets"
        self.override = workdir / "faults.override.yaml"
        self.override.write_text(OVERRIDE)
        self.port = free_port()
        self.env = os.environ | {"PDMESH_SECRETS": str(self.secrets),
                                 "PDMESH_GATEWAY_PORT": str(self.port),
                                 "PDMESH_MODELS": str(ROOT / "models")}
        self.url = f"http://127.0.0.1:{self.port}"
        self.network = f"{self.project}_default"

    def compose(self, *args: str, timeout: float = 900) -> str:
        return sh("docker-compose", "-p", self.project, "-f", "compose.yaml", "-f",
                  str(self.override), *args, timeout=timeout, env=self.env)

    def up(self) -> None:
        sh(sys.executable, "-m", "pdmesh.deploy.creds", str(self.secrets))
        self.compose("up", "-d", "--scale", "decode=2", "--scale", "prefill=2")

    def down(self) -> None:
        self.compose("down", "-v", "--timeout", "10", timeout=300)

    def container(self, service: str) -> str:
        """The first container of a service (nats: nats-1, one node of three)."""
        name = {"nats": "nats-1"}.get(service, service)
        ids = self.compose("ps", "-q", name).split()
        names = sorted(sh("docker", "inspect", "-f", "{{.Name}}", *ids).split())
        return names[0].lstrip("/")

    def stats(self, service: str) -> list[dict]:
        """Every instance's $SRV.STATS, asked from a container on the compose network."""
        pw = (self.secrets / "debug.password").read_text().strip()
        out = sh("docker", "run", "--rm", "--network", self.network,
                 "-e", "PDMESH_NATS_USER=debug", "-e", f"PDMESH_NATS_PASSWORD={pw}",
                 os.environ.get("PDMESH_IMAGE", "pdmesh:local"), "python", "-c",
                 "import asyncio, json; from shared import micro; "
                 "from shared.natsconn import NatsAuth\n"
                 "async def m():\n"
                 "    nc = await micro.connect_once('nats://nats-0:4222', auth=NatsAuth.from_env())\n"
                 f"    print(json.dumps([i.stats for i in await micro.stats(nc, '{service}', 1.0)]))\n"
                 "    await nc.close()\n"
                 "asyncio.run(m())", timeout=120)
        return json.loads(out.strip().splitlines()[-1])

    async def serving(self, decodes: int = 2, timeout_s: float = 300) -> float:
        """Seconds until the gateway counts `decodes` decodes and answers a request."""
        t0 = time.monotonic()
        body = {"model": "tiny-target", "prompt": [5] * 40, "max_tokens": 2,
                "temperature": 0.0}
        headers = {"Authorization": f"Bearer {api_key(self.secrets)}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            while time.monotonic() - t0 < timeout_s:
                try:
                    async with http.get(self.url + "/ready") as r:
                        ready = r.status == 200 and (await r.json()).get(
                            "decode_instances") == decodes
                    if ready:
                        async with http.post(self.url + "/v1/completions", json=body,
                                             headers=headers) as r:
                            if r.status == 200:
                                return time.monotonic() - t0
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"the cluster did not serve again within {timeout_s:.0f} s")


async def fault(c: Cluster, name: str, load: Load) -> float | None:
    if name == "none":
        return None
    kind, service, *rest = name.split("_")
    target = c.container(service)
    await load.mid_stream()
    if kind == "kill":
        log(f"docker kill {target}")
        sh("docker", "kill", target)
        await asyncio.sleep(2)
        sh("docker", "start", target)
    else:
        secs = int(rest[0].rstrip("s"))
        alias = {"nats": "nats-1"}.get(service, service)
        log(f"docker network disconnect {target} for {secs} s")
        sh("docker", "network", "disconnect", c.network, target)
        try:
            await asyncio.sleep(secs)
        finally:
            sh("docker", "network", "connect", "--alias", alias, c.network, target)
    return await c.serving()


async def scenario(c: Cluster, name: str, n: int, prompts, refs) -> dict:
    load = Load(c.url, prompts, "tiny-target", MAX_TOKENS, api_key(c.secrets))
    t0 = time.monotonic()
    runner = asyncio.ensure_future(load.run(n))
    recovery = await fault(c, name, load)
    await runner
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while (leaked := sum(s.get("blocks_used", 0) for s in c.stats("decode"))) \
            and time.monotonic() < deadline:
        await asyncio.sleep(1)
    res = load.results
    failed = load.failed()
    wrong = load.wrong(refs) if refs else []
    return {"scenario": name, "requests": len(res), "succeeded": len(res) - len(failed),
            "failed": len(failed), "wrong": len(wrong),
            "recovery_s": round(recovery, 2) if recovery is not None else None,
            "leaked_blocks": leaked,
            "hung": sum(1 for r in res if r["latency_s"] > 290),
            "max_stall_s": round(max((r["max_stall_s"] for r in res), default=0), 3),
            "p50_latency_s": round(sorted(r["latency_s"] for r in res)[len(res) // 2], 3),
            "wall_s": round(wall, 2), "error_samples": [r["error"] for r in failed[:3]]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
    for ax, key, title in zip(axes, ("failed", "wrong", "recovery_s", "p50_latency_s"),
                              ("failed requests (explicit errors)", "wrong outputs",
                               "serving again after the restart / reconnect (s)",
                               "p50 request latency (s)")):
        vals = [r.get(key) or 0 for r in rows]
        bars = ax.bar(names, vals, color="tab:red" if key in ("failed", "wrong") else "tab:blue")
        ax.bar_label(bars, labels=[f"{v:g}" for v in vals], fontsize=7)
        ax.set_ylim(0, max(1.0, max(vals, default=0) * 1.2))
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.suptitle("docker compose cluster (3 NATS, kvstore, jobstream, 2 prefill, 2 decode, "
                 "gateway): 32 greedy requests, 16 at a time, under each fault")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(a, workdir: Path) -> dict:
    from shared.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(ROOT / "models" / "tiny-target"))
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    t0 = time.monotonic()
    sh(str(ROOT / "scripts" / "image.sh"), timeout=1800)
    log(f"image ready in {time.monotonic() - t0:.0f} s")
    c = Cluster(workdir)
    rows: list[dict] = []
    try:
        t0 = time.monotonic()
        c.up()
        log(f"compose up: serving in {await c.serving(timeout_s=600) + time.monotonic() - t0:.0f} s")
        base = Load(c.url, prompts, "tiny-target", MAX_TOKENS, api_key(c.secrets))
        await base.run(len(prompts))
        assert not base.failed(), base.failed()[:2]
        refs = [r["tokens"] for r in sorted(base.results, key=lambda r: r["i"])]
        for name in a.scenarios.split(","):
            log(f"scenario {name}")
            rows.append(await scenario(c, name, a.requests, prompts, refs))
            log(json.dumps(rows[-1]))
    finally:
        c.down()
    return {"launched_by": "docker-compose -f compose.yaml up --scale decode=2 --scale prefill=2",
            "model": "tiny-target (mounted), --deterministic, the compose defaults otherwise",
            "max_tokens": MAX_TOKENS, "scenarios": rows}


def main() -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    a = ap.parse_args()
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        print("compose_faults: no docker daemon", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdmesh-faults-") as d:
        res = asyncio.run(main_async(a, Path(d)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose_faults.json").write_text(json.dumps(res, indent=1))
    plot(res["scenarios"], out / "compose_faults.png")
    for r in res["scenarios"]:
        print({k: v for k, v in r.items() if k != "error_samples"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
