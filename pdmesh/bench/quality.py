"""Held-out text and what a quantized engine's logits cost on it: perplexity, top-1
agreement with a reference engine, mean KL(reference || engine) per position
(scripts/bench_quant.py, scripts/bench_gguf_quant.py)."""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from shared.engine.engine import LLMEngine
from shared.engine.model import one_prompt


def held_out_texts() -> dict[str, str]:
    import json as json_mod
    import textwrap
    from pydoc_data.topics import topics
    prose = "\n\n".join(topics[k] for k in sorted(topics)[:40])
    code = "\n\n".join(inspect.getsource(m) for m in (textwrap, json_mod.decoder))
    return {"prose": prose, "code": code}


def window_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] for every position of one window, the prompt computed in one forward."""
    meta, kv = one_prompt(eng.model_cfg, len(ids), eng.cfg.torch_dtype, every_row=True)
    return eng.model.forward(torch.tensor(ids), meta, kv)


def text_metrics(engines: dict, ids: list[int], window: int) -> dict:
    nll = {v: 0.0 for v in engines}
    top1 = {v: 0 for v in engines}
    kl = {v: 0.0 for v in engines}
    n = 0
    for s in range(0, len(ids) - 1, window):
        w = ids[s:s + window + 1]
        if len(w) < 2:
            break
        tgt = torch.tensor(w[1:])
        ref = None
        for v, eng in engines.items():
            lg = window_logits(eng, w[:-1]).float()
            lp = F.log_softmax(lg, dim=-1)
            nll[v] += float(F.nll_loss(lp, tgt, reduction="sum"))
            if ref is None:
                ref = lp
            top1[v] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            kl[v] += float((ref.exp() * (ref - lp)).sum())
        n += len(tgt)
    return {v: {"tokens": n, "perplexity": float(torch.exp(torch.tensor(nll[v] / n))),
                "top1_agreement": top1[v] / n, "mean_kl": kl[v] / n} for v in engines}
