"""Anomaly monitor detection table (invariant 5): false positives on clean traffic, recall
on corrupted requests, and the clean distributions that thresholds are calibrated from.

  engine     the engine alone (no mesh): target + draft, non-deterministic mode, one torch
             thread, no prefix cache (a corrupted prompt block must not be shared)
  clean      varied requests: held-out stdlib code windows (16..96 tokens), short code
             starts (the first 2..12 tokens of a line, like tests/conftest.py's
             CODE_PROMPTS) and synthetic chats (rendered with the chat template), greedy
             and sampled, max_tokens 160..256, half with ignore_eos (long outputs are
             where the low rule can misfire); false positives are also given per source
  corrupted  the same mix; after a request's prompt is prefilled (its first token out)
             its prompt blocks are corrupted with services/decode/faults.py, exactly as
             decode does to received KV: zero_layer, swap (another running request's
             blocks), noise (1x the KV's std, and 3x / 10x); repeat_loop gets its logit
             bias at admission
  monitor    every output's cumulative spec counters are recorded; detection replays them
             through AnomalyMonitor (the decode service's core) under a MonitorConfig, so
             the numbers are the service's decisions, not a re-implementation

A rule can only judge a request past its gate (more than min_tokens_low generated; at least
min_proposed_high drafts), so rates are given over all requests and over "eligible" ones.
Calibration (used when the defaults flag more than --max-fp of clean requests): per clean
request the worst running value past the gate (lowest accept length, highest accept rate);
accept_length_low = its q-quantile minus a margin, accept_rate_high = its (1 - q)-quantile
plus a margin (q = --calib-q, default 0.001), so about q of clean traffic would fire before
the margin; both tables are reported.

Writes docs/bench/monitor_<model>.json and .png (clean vs corrupted distributions of those
worst running values, with the default and calibrated thresholds).

    python scripts/bench_monitor.py [--clean 500] [--corrupt 50] [--batch 16]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.decode import faults
from services.decode.monitor import RULES, AnomalyMonitor, MonitorConfig
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from synth_chat import chat_dialogue
from train_models import stdlib_sources

ROOT = Path(__file__).resolve().parents[1]


# row -> (faults.py kind, noise scale): the four kinds as decode injects them by default,
# then stronger noise, to show where detection starts
FAULTS = {"zero_layer": ("zero_layer", 1.0), "swap": ("swap", 1.0), "noise": ("noise", 1.0),
          "noise_x3": ("noise", 3.0), "noise_x10": ("noise", 10.0),
          "repeat_loop": ("repeat_loop", 1.0)}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(slots=True)
class Req:
    rid: str
    prompt: list[int] = field(repr=False)
    params: SamplingParams
    source: str                        # code | chat
    fault: str | None = None
    trace: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)
    corrupted: bool = False

    @property
    def final(self) -> tuple[int, int, int, int]:
        return self.trace[-1] if self.trace else (0, 0, 0, 0)


# ---- workload --------------------------------------------------------------------------
def prompt_pool(tok, n: int, seed: int) -> list[tuple[str, list[int]]]:
    """n prompts: 2/5 code windows, 1/5 short code starts (held-out stdlib files), 2/5 chats."""
    rng = random.Random(seed)
    _, held = stdlib_sources(2.0, 10)
    code_ids = [tok.encode(t) for t in held if len(t) > 2000]
    lines = [ln.strip() for t in held for ln in t.splitlines() if len(ln.strip()) > 12]
    out = []
    for i in range(n):
        if i % 5 in (0, 2):
            ids = rng.choice(code_ids)
            length = rng.randint(16, 96)
            start = rng.randrange(max(1, len(ids) - length))
            out.append(("code", ids[start:start + length]))
        elif i % 5 == 4:
            out.append(("code_short", tok.encode(rng.choice(lines))[:rng.randint(2, 12)]))
        else:
            out.append(("chat", tok.encode_chat(chat_dialogue(rng))))
    return out


def make_requests(tok, n: int, seed: int, tag: str, fault: str | None = None) -> list[Req]:
    rng = random.Random(seed)
    reqs = []
    for i, (source, prompt) in enumerate(prompt_pool(tok, n, seed)):
        kind = i % 3              # greedy, temperature 0.7 / top_p 0.95, temperature 1.0
        params = SamplingParams(
            temperature=(0.0, 0.7, 1.0)[kind], top_p=(1.0, 0.95, 1.0)[kind],
            seed=rng.getrandbits(48), max_tokens=rng.randint(160, 256),
            ignore_eos=rng.random() < 0.5)
        reqs.append(Req(f"{tag}-{i}", prompt, params, source, fault))
    return reqs


# ---- running ---------------------------------------------------------------------------
def make_engine(args) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=args.model, draft_model=args.draft, num_speculative_tokens=args.k,
        dtype=args.dtype, threads=1, num_blocks=4096, block_size=16,
        max_num_seqs=args.batch, max_num_batched_tokens=1024, chunk_size=512,
        prefix_cache=False))


def corrupt(eng: LLMEngine, r: Req) -> None:
    """r's prompt was just prefilled: corrupt its prompt blocks (as decode corrupts the KV
    prefill sent), before its first decode step."""
    kind, scale = FAULTS[r.fault]
    eng.port.tamper(r.rid, None, lambda kv, blocks, others: faults.corrupt(
        kind, kv, blocks, r.params.seed, others, scale))
    r.corrupted = True


def run(eng: LLMEngine, reqs: list[Req], batch: int, label: str, repeat_token: int) -> None:
    """Run every request to the end, `batch` at a time (continuous batching)."""
    pending, live = list(reqs), {}
    done, t0 = 0, time.monotonic()
    while pending or live:
        while pending and len(live) < batch:
            r = pending.pop(0)
            params = (faults.repeat_loop(r.params, repeat_token)
                      if r.fault == faults.REPEAT_LOOP else r.params)
            eng.add_request(r.rid, r.prompt, params)
            live[r.rid] = r
        for o in eng.step():
            r = live[o.request_id]
            r.trace.append((o.spec_steps, o.spec_proposed, o.spec_accepted,
                            o.num_output_tokens))
            if r.fault and r.fault != faults.REPEAT_LOOP and not r.corrupted \
                    and not o.finished:
                corrupt(eng, r)
            if o.finished:
                del live[o.request_id]
                done += 1
                if done % 25 == 0 or done == len(reqs):
                    tok = sum(x.final[3] for x in reqs)
                    log(f"  {label}: {done}/{len(reqs)} requests, {tok} tokens, "
                        f"{tok / (time.monotonic() - t0):.0f} tok/s")


# ---- evaluation ------------------------------------------------------------------------
def verdict(r: Req, cfg: MonitorConfig) -> str | None:
    """The rule the decode service's monitor would fire for r (None: none)."""
    mon = AnomalyMonitor(cfg)
    for steps, proposed, accepted, gen in r.trace:
        rule = mon.observe_totals(r.rid, steps, proposed, accepted, gen)
        if rule is not None:
            return rule
    return None


def worst(r: Req, cfg: MonitorConfig) -> tuple[float | None, float | None]:
    """Lowest running accept length past the low rule's gate, highest running accept rate
    past the high rule's gate (None: never past it)."""
    low = high = None
    for steps, proposed, accepted, gen in r.trace:
        if steps and gen > cfg.min_tokens_low:
            L = (accepted + steps) / steps
            low = L if low is None else min(low, L)
        if proposed >= cfg.min_proposed_high:
            R = accepted / proposed
            high = R if high is None else max(high, R)
    return low, high


def table(groups: dict[str, list[Req]], cfg: MonitorConfig) -> dict:
    """Per group: flagged share (all / eligible), by rule."""
    out = {}
    for name, reqs in groups.items():
        rules = [verdict(r, cfg) for r in reqs]
        w = [worst(r, cfg) for r in reqs]
        eligible = [i for i, (lo, hi) in enumerate(w) if lo is not None or hi is not None]
        flagged = [i for i, rule in enumerate(rules) if rule is not None]
        out[name] = {
            "requests": len(reqs), "eligible": len(eligible), "flagged": len(flagged),
            "rate": len(flagged) / len(reqs) if reqs else 0.0,
            "rate_eligible": (sum(1 for i in flagged if i in set(eligible)) / len(eligible)
                              if eligible else 0.0),
            "by_rule": {rule: rules.count(rule) for rule in RULES},
            "by_source": {src: share(reqs, rules, lambda r, s=src: r.source == s)
                          for src in sorted({r.source for r in reqs})},
            "by_sampling": {"greedy": share(reqs, rules, lambda r: r.params.greedy),
                            "sampled": share(reqs, rules, lambda r: not r.params.greedy)}}
    return out


def share(reqs: list[Req], rules: list[str | None], pred) -> str:
    """"flagged/total" over the requests pred() selects."""
    idx = [i for i, r in enumerate(reqs) if pred(r)]
    return f"{sum(1 for i in idx if rules[i])}/{len(idx)}"


def quantile(xs: list[float], q: float, interpolation: str = "linear") -> float:
    if not xs:
        return float("nan")
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q,
                                interpolation=interpolation))


def distribution(xs: list[float]) -> dict:
    qs = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)
    return {"n": len(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None,
            **{f"p{q * 100:g}": quantile(xs, q) for q in qs}}


def calibrate(clean: list[Req], base: MonitorConfig, q: float, margin_len: float,
              margin_rate: float) -> MonitorConfig:
    """Thresholds from the clean requests' worst running values: the q-quantile taken as
    an order statistic on the safe side (with fewer than 1/q requests: the extreme), a
    margin beyond it, and never less conservative than `base`."""
    w = [worst(r, base) for r in clean]
    lows = [lo for lo, _ in w if lo is not None]
    highs = [hi for _, hi in w if hi is not None]
    low, high = base.accept_length_low, base.accept_rate_high
    if lows:
        low = min(low, max(1.0, round(quantile(lows, q, "lower") - margin_len, 2)))
    if highs:
        high = max(high, min(1.0, round(quantile(highs, 1 - q, "higher") + margin_rate, 3)))
    return MonitorConfig(min_tokens_low=base.min_tokens_low, accept_length_low=low,
                         accept_rate_high=high, min_proposed_high=base.min_proposed_high)


def holdout(clean: list[Req], base: MonitorConfig, *calib) -> list[dict]:
    """Two-fold check of the calibration: thresholds from one half of the clean requests,
    false positives counted on the other half."""
    halves = (clean[0::2], clean[1::2])
    out = []
    for fit, test in (halves, halves[::-1]):
        cfg = calibrate(fit, base, *calib)
        flagged = sum(1 for r in test if verdict(r, cfg) is not None)
        out.append({"accept_length_low": cfg.accept_length_low,
                    "accept_rate_high": cfg.accept_rate_high,
                    "false_positives": f"{flagged}/{len(test)}"})
    return out


# ---- report ----------------------------------------------------------------------------
def plot(groups: dict[str, list[Req]], configs: dict[str, MonitorConfig], out: Path,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(iter(configs.values()))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for ax, idx, name, bins in ((axes[0], 0, "lowest running accept length past the gate",
                                 [1 + i * 0.05 for i in range(81)]),
                                (axes[1], 1, "highest running accept rate past the gate",
                                 [i * 0.02 for i in range(51)])):
        for g, reqs in groups.items():
            xs = [worst(r, base)[idx] for r in reqs]
            xs = [x for x in xs if x is not None]
            if xs:
                ax.hist(xs, bins=bins, alpha=0.45 if g == "clean" else 0.7,
                        label=f"{g} (n={len(xs)})",
                        histtype="stepfilled" if g == "clean" else "step", linewidth=1.5)
        for (cname, cfg), style in zip(configs.items(), ("--", ":")):
            thr = cfg.accept_length_low if idx == 0 else cfg.accept_rate_high
            ax.axvline(thr, color="k", linestyle=style, label=f"{cname} threshold {thr:g}")
        ax.set_xlabel(name)
        ax.set_ylabel("requests (log scale: the clean tail is what matters)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def print_table(name: str, t: dict) -> None:
    log(f"{name}:")
    for g, row in t.items():
        what = "false positives" if g == "clean" else "recall"
        log(f"  {g:12s} {what:15s} {row['flagged']:4d}/{row['requests']:<4d} = "
            f"{row['rate']:7.2%}  (eligible {row['eligible']:4d}: {row['rate_eligible']:7.2%})  "
            + ", ".join(f"{k} {v}" for k, v in row["by_rule"].items())
            + (f"; by source {row['by_source']}, {row['by_sampling']}" if g == "clean" else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "tiny-draft"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--clean", type=int, default=500)
    ap.add_argument("--corrupt", type=int, default=50, help="requests per corruption kind")
    ap.add_argument("--kinds", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-fp", type=float, default=0.005,
                    help="calibrate when the defaults flag more clean requests than this")
    ap.add_argument("--calib-q", type=float, default=0.001)
    ap.add_argument("--margin-length", type=float, default=0.05)
    ap.add_argument("--margin-rate", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    eng = make_engine(args)
    tok = eng.tokenizer
    repeat_token = tok.encode(" the")[-1]
    log(f"{Path(args.model).name} + {Path(args.draft).name}, k={args.k}, {args.dtype}, "
        f"batch {args.batch}, threads {torch.get_num_threads()}")
    groups = {"clean": make_requests(tok, args.clean, args.seed, "clean")}
    for j, kind in enumerate(args.kinds):
        groups[kind] = make_requests(tok, args.corrupt, args.seed + 1000 * (j + 1), kind, kind)
    t0 = time.monotonic()
    for name, reqs in groups.items():
        log(f"{name}: {len(reqs)} requests")
        run(eng, reqs, args.batch, name, repeat_token)
    wall = time.monotonic() - t0

    default = MonitorConfig()
    tables = {"default": table(groups, default)}
    configs = {"default": default}
    fp = tables["default"]["clean"]["rate"]
    calib = (args.calib_q, args.margin_length, args.margin_rate)
    calibrated = calibrate(groups["clean"], default, *calib)
    if fp > args.max_fp:
        configs["calibrated"] = calibrated
        tables["calibrated"] = table(groups, calibrated)
    base = default
    clean_low = [w[0] for w in map(lambda r: worst(r, base), groups["clean"]) if w[0] is not None]
    clean_high = [w[1] for w in map(lambda r: worst(r, base), groups["clean"]) if w[1] is not None]
    final_len = [(r.final[2] + r.final[0]) / r.final[0] for r in groups["clean"] if r.final[0]]
    final_rate = [r.final[2] / r.final[1] for r in groups["clean"] if r.final[1]]
    res = {
        "model": Path(args.model).name, "draft": Path(args.draft).name, "k": args.k,
        "dtype": args.dtype, "batch": args.batch, "threads": torch.get_num_threads(),
        "clean_requests": args.clean, "corrupt_requests_per_kind": args.corrupt,
        "wall_s": round(wall, 1),
        "tokens": {g: sum(r.final[3] for r in reqs) for g, reqs in groups.items()},
        "configs": {k: asdict(v) for k, v in configs.items()},
        "calibration": {"method": f"accept_length_low = min(default, q{args.calib_q:g} "
                                  f"quantile (lower order statistic) of clean requests' lowest "
                                  f"running accept length past the gate - {args.margin_length}); "
                                  f"accept_rate_high = max(default, q{1 - args.calib_q:g} "
                                  f"quantile (higher order statistic) of their highest running "
                                  f"accept rate + {args.margin_rate}, capped at 1)",
                        "applied": "calibrated" in configs,
                        "suggested": asdict(calibrated),
                        "two_fold_holdout": holdout(groups["clean"], default, *calib)},
        "tables": tables,
        "clean_distribution": {
            "worst_running_accept_length": distribution(clean_low),
            "worst_running_accept_rate": distribution(clean_high),
            "final_accept_length": distribution(final_len),
            "final_accept_rate": distribution(final_rate)},
        "corrupted_distribution": {
            g: {"worst_running_accept_length": distribution(
                    [w[0] for w in map(lambda r: worst(r, base), reqs) if w[0] is not None]),
                "worst_running_accept_rate": distribution(
                    [w[1] for w in map(lambda r: worst(r, base), reqs) if w[1] is not None])}
            for g, reqs in groups.items() if g != "clean"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"monitor_{res['model']}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    plot(groups, configs, out / f"{stem}.png",
         f"anomaly monitor: {res['model']} + {res['draft']} (k={args.k}); "
         f"{args.clean} clean, {args.corrupt} per corruption kind")
    for name, t in tables.items():
        print_table(f"{name} thresholds {asdict(configs[name])}", t)
    for name, d in res["clean_distribution"].items():
        log(f"clean {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()
                                          if k != "n" and v is not None))
    log(f"calibration two-fold holdout: {res['calibration']['two_fold_holdout']}")
    log(f"wrote {out / stem}.json and .png ({wall:.0f}s of generation)")


if __name__ == "__main__":
    main()
