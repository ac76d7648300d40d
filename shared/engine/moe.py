"""Sparse (mixture-of-experts) layers, as Qwen3-MoE and transformers route them: softmax
over the router's logits in float32, the top experts_per_tok, renormalised when
norm_topk_prob; each chosen expert runs once on the rows routed to it, so a step reads
only the routed experts' weights. In deterministic mode the mlp it is given runs its
matmuls in fixed tiles (model.linear), so a row's result does not depend on which others
share its expert."""
from __future__ import annotations

from collections.abc import Callable

import torch


def route(x: torch.Tensor, router_logits: torch.Tensor, experts: list, cfg,
          mlp: Callable) -> torch.Tensor:
    """x [T, H] -> [T, H]: experts[e] = (gate|up, down) weights, mlp(x, *experts[e])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weight, chosen = torch.topk(probs, cfg.experts_per_tok, dim=-1)     # [T, k]
    if cfg.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    weight = weight.to(x.dtype)
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, k = torch.where(chosen == e)
        y = mlp(x[rows], *experts[e])
        out.index_add_(0, rows, y * weight[rows, k, None])
    return out


def expert_weights(weights: dict, p: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's (gate|up [2I, H], down [H, I]) of layer prefix p: from the [E, ...]
    tensors transformers 5 saves, or from one set per expert (the Hub's Qwen3-MoE)."""
    fused = weights.get(p + "mlp.experts.gate_up_proj")
    if fused is not None:
        down = weights[p + "mlp.experts.down_proj"]
        return [(fused[e].contiguous(), down[e].contiguous()) for e in range(n)]
    x = p + "mlp.experts.{}."
    return [(torch.cat([weights[x.format(e) + "gate_proj.weight"],
                        weights[x.format(e) + "up_proj.weight"]]).contiguous(),
             weights[x.format(e) + "down_proj.weight"]) for e in range(n)]
