"""Chaos run at scale: python scripts/chaos.py --requests 10000 [--no-reclaim-ack]
[--no-epoch-fence] [--out chaos.json]. See pdmesh/chaos.py for what it does; prints the
headline and writes every number as JSON. Exit status 1 when a completed request differs
from its reference, a block leaked, or a service is unhealthy."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdmesh.chaos import ChaosConfig, headline, run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--abort-rate", type=float, default=0.4)
    ap.add_argument("--storms", type=int, default=10)
    ap.add_argument("--storm-size", type=int, default=24)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL a prefill")
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--write-delay", type=float, default=0.1, metavar="S",
                    help="max random delay of each KV write once issued")
    ap.add_argument("--kv-window", type=int, default=2)
    ap.add_argument("--lease", type=float, default=3.0, metavar="S")
    ap.add_argument("--no-reclaim-ack", action="store_true", help="TEST: disable reclaim-ack")
    ap.add_argument("--no-epoch-fence", action="store_true", help="TEST: disable epoch fencing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args()
    cfg = ChaosConfig(model=a.model, requests=a.requests, concurrency=a.concurrency,
                      abort_rate=a.abort_rate, storms=a.storms, storm_size=a.storm_size,
                      prefill=a.prefill, kill_prefill=not a.no_kill, num_blocks=a.num_blocks,
                      write_delay_s=a.write_delay, kv_window=a.kv_window, lease_s=a.lease,
                      reclaim_ack=not a.no_reclaim_ack, epoch_fence=not a.no_epoch_fence,
                      seed=a.seed, log_dir=a.log_dir)
    res = run(cfg)
    text = json.dumps(res, indent=2)
    print(text)
    print(headline(res))
    if a.out:
        Path(a.out).write_text(text + "\n")
    bad = res["mismatches"] or res["blocks_leaked"] or res["unhealthy"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
