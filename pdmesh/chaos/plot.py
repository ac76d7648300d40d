"""The PNGs of scripts/chaos.py: one run over time (requests, decode's blocks, the hazards
the guards met, and the bound the run puts on the corruption rate), or the four guard
configurations side by side."""
from __future__ import annotations

from pathlib import Path

from pdmesh.chaos.report import rate_bound

OUTCOME_COLORS = {"unclaimed": "tab:gray", "acked": "tab:green", "lease": "tab:orange",
                  "unprotected": "tab:red"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(res: dict, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    tl = res.get("timeline") or []
    ts = [p["t_s"] for p in tl]
    _requests_panel(ax[0, 0], tl, ts)
    _blocks_panel(ax[0, 1], tl, ts)
    _hazard_panel(ax[1, 0], tl, ts)
    _bound_panel(ax[1, 1], res)
    _events(ax[0, 0], res.get("events") or [])
    b = res.get("per_10k_bound_95")
    bound = (f"\n0 mismatches in {res['completed']:,}: corruption rate < {b:.2f} per 10,000 "
             f"completed requests (95%)" if b is not None else "")
    fig.suptitle(f"chaos, guards {res['guards']}: {res['requests']:,} requests "
                 f"({res.get('requests_per_s')}/s), {res['completed']:,} completed and "
                 f"compared, {res['mismatches']} mismatches, {res['errors']} errors, "
                 f"{res.get('blocks_leaked')} blocks leaked{bound}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _requests_panel(a, tl: list[dict], ts: list[float]) -> None:
    for k, c in (("sent", "tab:blue"), ("completed", "tab:green"),
                 ("cancelled", "tab:orange"), ("mismatches", "tab:red"),
                 ("errors", "black")):
        a.plot(ts, [p[k] for p in tl], c=c, label=k)
    a.set_title("client requests (cumulative; dotted: storms, prefill kill/restart)")
    a.set_xlabel("s")
    a.legend(fontsize=8)


def _events(a, events: list[dict]) -> None:
    """The kill and restart (red) and the storms (grey) as vertical lines."""
    for e in events:
        storm = e["event"].startswith("storm")
        a.axvline(e["t_s"], c="tab:gray" if storm else "tab:red", ls=":", lw=0.8)


def _blocks_panel(a, tl: list[dict], ts: list[float]) -> None:
    for k, c in (("blocks_used", "tab:blue"), ("blocks_quarantined", "tab:orange"),
                 ("awaiting_kv", "tab:purple"), ("requests_quarantined", "tab:red")):
        a.plot(ts, [p["decode"].get(k, 0) for p in tl], c=c, label=k)
    a.set_title("decode now (sampled)")
    a.set_xlabel("s")
    a.legend(fontsize=8)


def _hazard_panel(a, tl: list[dict], ts: list[float]) -> None:
    """Writes the guards met, and reclaims by outcome, cumulative."""
    for k, c in (("kv_writes_fenced", "tab:red"), ("kv_writes_quarantined", "tab:orange"),
                 ("kv_writes_stray", "tab:gray")):
        a.plot(ts, [p["decode"].get(k, 0) for p in tl], c=c, label=k)
    outcomes = sorted({o for p in tl for o in p["decode"].get("reclaims_by_outcome", {})})
    for o in outcomes:
        a.plot(ts, [p["decode"].get("reclaims_by_outcome", {}).get(o, 0) for p in tl], "--",
               c=OUTCOME_COLORS.get(o), label=f"reclaims {o}")
    a.set_title("late writes met, reclaims by outcome (cumulative)")
    a.set_xlabel("s")
    a.legend(fontsize=8)


def _bound_panel(a, res: dict) -> None:
    """The 95% upper bound on the corruption rate per completed request, 0 mismatches in n."""
    n = res["completed"]
    if not n:
        return
    top = max(n, 40_000)
    xs = sorted({max(1, int(top * f / 200)) for f in range(1, 201)} | {n})
    a.plot(xs, [rate_bound(x) * 1e4 for x in xs], c="tab:blue", ls=":",
           label="95% bound with 0 mismatches in n")
    a.plot([n], [rate_bound(n) * 1e4], "o", c="tab:blue", label="this run")
    a.axhline(3, c="tab:orange", ls="--", label="3 per 10k (GLM-5 production, after fixes)")
    a.axhline(1, c="tab:green", ls="--", label="1 per 10k")
    if res["mismatches"]:
        a.axhline(res["mismatch_rate"] * 1e4, c="tab:red", label="seen")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("completed requests compared (n)")
    a.set_ylabel("corrupted per 10,000")
    a.set_title(f"what the run bounds: n = {n:,}")
    a.legend(fontsize=8)


def plot_compare(res: dict, out: Path) -> None:
    """Bars per guard configuration: mismatches, the hazards met, reclaim outcomes."""
    plt = _plt()
    runs = res["runs"]
    names = list(runs)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.8))
    ax[0].bar(names, [runs[g]["mismatches"] for g in names],
              color=["tab:red" if runs[g]["mismatches"] else "tab:green" for g in names])
    for i, g in enumerate(names):
        ax[0].annotate(f"{runs[g]['mismatches']} / {runs[g]['completed']}",
                       (i, runs[g]["mismatches"]), ha="center", va="bottom", fontsize=9)
    ax[0].set_ylim(0, 1.15 * max(1, *(runs[g]["mismatches"] for g in names)))
    ax[0].set_title("mismatches / completed requests")
    width = 0.27
    for j, (k, c) in enumerate((("kv_writes_fenced", "tab:red"),
                                ("kv_writes_quarantined", "tab:orange"),
                                ("kv_writes_stray", "tab:gray"))):
        ax[1].bar([i + (j - 1) * width for i in range(len(names))],
                  [runs[g].get(k, 0) for g in names], width, color=c, label=k)
    ax[1].set_xticks(range(len(names)), names)
    ax[1].set_title("late KV writes met")
    ax[1].legend(fontsize=8, ncol=2)
    bottom = [0] * len(names)
    for o, c in OUTCOME_COLORS.items():
        ys = [runs[g]["reclaims_by_outcome"].get(o, 0) for g in names]
        ax[2].bar(names, ys, bottom=bottom, color=c, label=o)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax[2].set_title("reclaims by outcome")
    for a in ax[1:]:
        a.set_ylim(0, 1.3 * a.get_ylim()[1])      # room for the legend above the bars
    ax[2].legend(fontsize=8, ncol=2)
    r0 = runs[names[0]]
    fig.suptitle(f"chaos negative controls: {r0['requests']:,} requests per configuration "
                 f"(seed {r0['config']['seed']}); guards: both, fence only (reclaim-ack off), "
                 f"ack only (epoch fence off), none")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
