"""Chaos run at scale (invariant 3; see pdmesh/chaos/run.py for what it does).

    python scripts/chaos.py --completed 30000                 both guards, until 30,000
                                                              requests completed (< 1 per
                                                              10,000 at 95% with 0 mismatches)
    python scripts/chaos.py --no-reclaim-ack                  fence only (also --guards fence_only)
    python scripts/chaos.py --no-epoch-fence                  ack only
    python scripts/chaos.py --guards all --requests 2000      the four side by side
    python scripts/chaos.py --hazard --guards all             the negative controls' settings

Writes <out>/chaos_[<guards>_]<model>.json and .png (chaos_guards_<model>.* for --guards
all); while it runs, <stem>.partial.json every --save-every seconds (the numbers so far,
so an interrupted run still leaves them), removed at the end. Progress lines on stdout.
Exit status 1 when a guarded configuration has a mismatch, an error, a leaked block or an
unhealthy service, or when the unguarded one has no mismatch."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdmesh.chaos.plot import plot_compare, plot_run
from pdmesh.chaos.report import compare, sound
from pdmesh.chaos.run import GUARDS, HAZARD, ChaosConfig, headline, run, with_guards

ROOT = Path(__file__).resolve().parents[1]



def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--requests", type=int, default=None,
                    help="default 10000 (--hazard 300; with --completed N, 1.85 N)")
    ap.add_argument("--completed", type=int, default=0, metavar="N",
                    help="send on past --requests until N requests completed (were compared)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--abort-rate", type=float, default=None)
    ap.add_argument("--storms", type=int, default=None,
                    help="abort storms, spread over the run (default one per 1,000 requests)")
    ap.add_argument("--storm-size", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=None)
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL a prefill")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--write-delay", type=float, default=None, metavar="S",
                    help="max random delay of each KV write once issued")
    ap.add_argument("--kv-window", type=int, default=None)
    ap.add_argument("--no-kv-stream", action="store_true",
                    help="prefill's default whole-prompt writes instead of layer-wise ones")
    ap.add_argument("--kv-max-write-bytes", type=int, default=None, metavar="B",
                    help="prefill's largest KV write (default 16384: two layers of one block; "
                         "8388608: a chaos prompt's whole KV in one write, which carries its "
                         "PrefillDone)")
    ap.add_argument("--lease", type=float, default=None, metavar="S")
    ap.add_argument("--hazard", action="store_true",
                    help="start from the negative controls' settings (pdmesh.chaos.run.HAZARD)")
    ap.add_argument("--guards", choices=[*GUARDS, "all"], default=None)
    ap.add_argument("--no-reclaim-ack", action="store_true", help="TEST: disable reclaim-ack")
    ap.add_argument("--no-epoch-fence", action="store_true", help="TEST: disable epoch fencing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"), help="folder for JSON + PNG")
    ap.add_argument("--name", default=None, help="file stem (default chaos_..._<model>)")
    ap.add_argument("--save-every", type=float, default=60.0, metavar="S",
                    help="write the partial JSON this often")
    a = ap.parse_args()
    if a.guards and (a.no_reclaim_ack or a.no_epoch_fence):
        ap.error("--guards and --no-reclaim-ack/--no-epoch-fence: use one")
    if not a.guards:
        a.guards = {(False, False): "both", (True, False): "fence_only",
                    (False, True): "ack_only", (True, True): "none"}[
                        (a.no_reclaim_ack, a.no_epoch_fence)]
    return a


def config(a: argparse.Namespace) -> ChaosConfig:
    base = ChaosConfig(model=a.model, requests=10_000, seed=a.seed,
                       log_dir=a.log_dir, concurrency=a.concurrency)
    if a.hazard:
        base = replace(base, **HAZARD)
    if a.completed and a.requests is None:
        a.requests = int(a.completed * 1.85)      # ~54% complete at the default abort rate
    given = dict(requests=a.requests, min_completed=a.completed or None,
                 abort_rate=a.abort_rate, storms=a.storms, storm_size=a.storm_size,
                 prefill=a.prefill, num_blocks=a.num_blocks, write_delay_s=a.write_delay,
                 kv_window=a.kv_window, lease_s=a.lease,
                 kv_max_write_bytes=a.kv_max_write_bytes)
    cfg = replace(base, **{k: v for k, v in given.items() if v is not None})
    if a.storms is None and not a.hazard:
        cfg = replace(cfg, storms=max(3, cfg.requests // 1000))
    if a.no_kv_stream:
        cfg = replace(cfg, kv_stream=False)
    return replace(cfg, kill_prefill=False) if a.no_kill else cfg


class Saver:
    """The partial JSON, at most every period_s (and the final files)."""

    def __init__(self, out: Path, stem: str, period_s: float):
        out.mkdir(parents=True, exist_ok=True)
        self.json, self.png = out / f"{stem}.json", out / f"{stem}.png"
        self.partial = out / f"{stem}.partial.json"
        self.period_s, self.last = period_s, 0.0
        self.done: dict[str, dict] = {}       # --guards all: the finished runs

    def on_sample(self, res: dict, guards: str | None = None) -> None:
        now = time.monotonic()
        if now - self.last < self.period_s:
            return
        self.last = now
        data = res if guards is None else {"partial": True, "runs": self.done | {guards: res}}
        _write(self.partial, data)

    def final(self, res: dict, plot) -> None:
        _write(self.json, res)
        plot(res, self.png)
        self.partial.unlink(missing_ok=True)
        print(f"wrote {self.json} and {self.png}", flush=True)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def one(cfg: ChaosConfig, saver: Saver) -> int:
    res = run(cfg, saver.on_sample)
    saver.final(res, plot_run)
    print(headline(res))
    ok = res["mismatches"] > 0 if cfg.guards == "none" else sound(res)
    return 0 if ok else 1


def all_four(cfg: ChaosConfig, saver: Saver) -> int:
    for g in GUARDS:
        res = run(with_guards(cfg, g), lambda r, g=g: saver.on_sample(r, g))
        print(headline(res), flush=True)
        saver.done[g] = res
    cmp = compare(saver.done)
    saver.final({"runs": saver.done, **cmp}, plot_compare)
    for p in cmp["problems"]:
        print("PROBLEM:", p)
    return 1 if cmp["problems"] else 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    a = args()
    cfg = config(a)
    model = Path(a.model).name
    if a.guards == "all":
        stem = a.name or f"chaos_guards_{model}"
    else:
        cfg = with_guards(cfg, a.guards)
        stem = a.name or ("chaos_" + ("" if a.guards == "both" else a.guards + "_") + model)
    saver = Saver(Path(a.out), stem, a.save_every)
    # Ctrl-C, or kill: the mesh is stopped, the partial JSON stays (also when started in
    # the background, where SIGINT would be ignored)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return all_four(cfg, saver) if a.guards == "all" else one(cfg, saver)
    except KeyboardInterrupt:
        left = (f"the numbers so far are in {saver.partial}" if saver.partial.exists()
                else "no numbers yet")
        print(f"interrupted: {left}", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
