"""The PNG of `pdmesh bench`: TTFT, ITL and tokens/s by concurrency for each path, and KV
transfer against the raw NATS baseline."""
from __future__ import annotations

from pathlib import Path


def plot(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    _latency_panels(ax, res)
    _kv_panel(ax[1, 1], res["kv"])
    r = res["ratios"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    fig.suptitle(f"pdmesh {res['model']}: PD/colocated at c=1: TTFT "
                 f"{f(r.get('pd_vs_colocated_ttft_c1'))}x, ITL "
                 f"{f(r.get('pd_vs_colocated_itl_c1'))}x; KV transfer / raw NATS "
                 f"{f(r.get('kv_vs_raw_nats'))}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _latency_panels(ax, res: dict) -> None:
    """TTFT, ITL and tokens/s by concurrency, one line per path."""
    colors = {"pd": "tab:blue", "colocated": "tab:orange"}
    for p, by_c in res["runs"].items():
        cs = sorted(by_c, key=int)
        xs = [int(c) for c in cs]

        def ys(f):
            return [f(by_c[c]) for c in cs]

        def ms(x):
            return None if x is None else x * 1e3
        col = colors.get(p)
        ax[0, 0].plot(xs, ys(lambda r: ms(r["ttft_s"]["p50"])), "o-", c=col, label=f"{p} p50")
        ax[0, 0].plot(xs, ys(lambda r: ms(r["ttft_s"]["p90"])), "o--", c=col, alpha=.5,
                      label=f"{p} p90")
        ax[0, 1].plot(xs, ys(lambda r: ms(r["itl_s"]["mean"])), "o-", c=col, label=f"{p} mean")
        ax[0, 1].plot(xs, ys(lambda r: ms(r["itl_s"]["p90"])), "o--", c=col, alpha=.5,
                      label=f"{p} p90")
        ax[1, 0].plot(xs, ys(lambda r: r["tokens_per_s"]), "o-", c=col, label=p)
        lr = res["long"].get(p)
        if lr and lr["ttft_s"]["p50"] is not None:
            ax[0, 0].plot([1], [lr["ttft_s"]["p50"] * 1e3], "s", c=col, mfc="none", ms=9,
                          label=f"{p} long prompt p50")
    levels = sorted({int(c) for by_c in res["runs"].values() for c in by_c})
    for a, title, yl in ((ax[0, 0], "TTFT", "ms"), (ax[0, 1], "inter-token latency", "ms"),
                         (ax[1, 0], "output tokens/s", "tokens/s")):
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(c) for c in levels])
        a.minorticks_off()
        a.set_xlabel("concurrency")
        a.set_title(title)
        a.set_ylabel(yl)
        a.legend(fontsize=7)
        a.grid(alpha=.3)


def _kv_panel(a, kv: dict) -> None:
    """KV transfer throughput per phase: the mesh's, raw NATS at its window and at 1."""
    groups = [ph for ph in ("all", "short", "long") if kv.get(ph)]
    series = (("bytes_per_s", "mesh (prefill kv_bytes / kv_transfer_s)", "tab:blue"),
              ("raw_bytes_per_s", f"raw NATS, window {kv['window']}", "tab:gray"),
              ("raw_window1_bytes_per_s", "raw NATS, window 1", "silver"))
    for j, (key, name, col) in enumerate(series):
        xs = [i + (j - 1) * 0.27 for i in range(len(groups))]
        vals = [(kv[ph].get(key) or 0) / 1e6 for ph in groups]
        bars = a.bar(xs, vals, 0.27, color=col, label=name)
        a.bar_label(bars, fmt="%.0f", fontsize=7)
    a.set_xticks(range(len(groups)),
                 [f"{ph} PD runs\n{kv[ph]['mean_write_bytes'] / 1024:.0f} KiB/write"
                  for ph in groups])
    a.legend(fontsize=7)
    a.set_ylabel("MB/s")
    a.set_title("KV transfer vs raw NATS (same payload sizes)")
