"""How often the repetition rule (services/decode/monitor.py) fires on text that is not a
loop: held-out human-written text, tokenized with the default model's tokenizer and cut
into 512-token "answers", fed to the monitor token by token at its defaults (window 128,
period <= 64, at least 3 copies). Code is included because it repeats itself legitimately (tables, enums,
similar lines): this Python's standard library and the repo's own sources; prose from
the repo's docs. And, as the positive controls, the same answers with a loop appended: a
phrase (2-12 tokens) or a sentence (13-60 tokens) over and over.

    python scripts/bench_repetition_fp.py [--out docs/bench] [--limit 4000]

Writes <out>/repetition_fp.json and .png.
"""
from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

from services.decode.monitor import AnomalyMonitor, MonitorConfig, Rule
from shared.engine.gguf_convert import convert, default_model_dir
from shared.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ANSWER = 512


def corpora() -> dict[str, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {"code_stdlib": sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts
                                  and "site-packages" not in p.parts),
            "code_repo": sorted(p for d in ("services", "shared", "pdmesh", "kernels")
                                for p in (ROOT / d).rglob("*.py")),
            "prose_docs": sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]}


def answers(tok: Tokenizer, files: list[Path], limit: int) -> list[list[int]]:
    out = []
    for f in files:
        try:
            ids = tok.encode(f.read_text(errors="replace"))
        except (OSError, ValueError):
            continue
        out += [ids[i:i + ANSWER] for i in range(0, len(ids) - ANSWER // 2, ANSWER)]
        if len(out) >= limit:
            break
    return out[:limit]


def fires(ids: list[int]) -> bool:
    mon = AnomalyMonitor(MonitorConfig(spec_rules=False))
    return any(mon.observe_tokens("a", [t]) == Rule.REPETITION for t in ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--limit", type=int, default=4000, help="answers per corpus at most")
    a = ap.parse_args()
    tok = Tokenizer.from_pretrained(convert(default_model_dir()))
    rng = random.Random(0)
    c = MonitorConfig()
    res = {"window": c.repeat_window, "max_period": c.repeat_max_period,
           "min_copies": c.repeat_min_copies,
           "answer_tokens": ANSWER, "corpora": {}}
    for name, files in corpora().items():
        t = time.perf_counter()
        ans = answers(tok, files, a.limit)
        fired = [i for i, x in enumerate(ans) if fires(x)]
        # the controls: the answer, then ~300 tokens of a loop: a phrase (2..12 tokens,
        # "la femme, la femme") or a sentence (13..60 tokens: "L'Etoile est le 21e de
        # l'Etoile, la Marseillaise, la Cité, la Cité, la Bohème.\n\n" is 38)
        caught = {}
        for kind, lo, hi in (("phrase", 2, 12), ("sentence", 13, 60)):
            caught[kind] = 0
            for x in ans[:200]:
                span = x[rng.randrange(len(x) - hi):][:rng.randint(lo, hi)]
                caught[kind] += fires(x[:rng.randint(20, 200)] + span * (300 // len(span)))
        n = min(200, len(ans))
        res["corpora"][name] = {"answers": len(ans), "files": len(files),
                                "fired": len(fired), "rate": len(fired) / max(1, len(ans)),
                                "examples": [tok.decode(ans[i])[-300:] for i in fired[:3]],
                                "control_loops": n, "control_caught": caught["phrase"],
                                "control_sentence_caught": caught["sentence"]}
        print(f"[repetition_fp] {name}: {len(fired)}/{len(ans)} normal answers fired "
              f"({100 * len(fired) / max(1, len(ans)):.3f}%), loops caught: phrases "
              f"{caught['phrase']}/{n}, sentences {caught['sentence']}/{n} "
              f"({time.perf_counter() - t:.0f}s)", flush=True)
    total = sum(c["answers"] for c in res["corpora"].values())
    res["overall_rate"] = sum(c["fired"] for c in res["corpora"].values()) / max(1, total)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repetition_fp.json").write_text(json.dumps(res, indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = list(res["corpora"])
    ax.bar(names, [100 * res["corpora"][n]["rate"] for n in names], color="tab:red",
           label="normal answers flagged (%)")
    for key, color, label in (("control_caught", "tab:green", "phrase loops caught (%)"),
                              ("control_sentence_caught", "tab:blue",
                               "sentence loops caught (%)")):
        ax.bar(names, [100 * res["corpora"][n][key] / max(1, res["corpora"][n]
                                                          ["control_loops"])
                       for n in names], alpha=0.25, color=color, label=label)
    ax.set_ylabel("%")
    ax.set_title(f"repetition rule (window {res['window']}, period <= {res['max_period']}, "
                 f">= {res['min_copies']} copies): "
                 f"false positives {100 * res['overall_rate']:.3f}% of {total}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "repetition_fp.png")
    print(f"[repetition_fp] overall {100 * res['overall_rate']:.3f}% of {total} answers; wrote "
          f"{out / 'repetition_fp.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
