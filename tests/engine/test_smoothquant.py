"""SmoothQuant (shared/engine/smooth.py): q|k|v and down on int8 activations after
per-channel smoothing calibrated at load. Outlier channels survive the per-row int8
quantization, few-row forwards keep the weight-only kernel, the engine calibrates once
and marks its KV as its own, and on the real model smoothing is what makes these two
projections' W8A8 accurate."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine import model as model_mod, quant
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.model import one_prompt
from shared.engine.quant import Int4Weight, Int8Weight
from shared.engine.smooth import Observed, SmoothedWeight, smoothing


def _outlier_batch(rows: int = 16, k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x with a few channels ~60x the rest (as after an LLM's layernorm), and w."""
    torch.manual_seed(0)
    x = torch.randn(rows, k)
    x[:, [3, 70, 200]] *= 60.0
    w = torch.randn(128, k) * 0.05
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def test_smoothing_keeps_outlier_channels_that_per_row_int8_loses():
    x, w = _outlier_batch()
    want = x.float() @ w.float().T
    plain = Int8Weight(w, a8=True).mm(x)                       # per-row int8 activations
    seen = Observed(Int4Weight(w))
    seen.mm(x)
    s = smoothing(w, seen.amax)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)   # powers of two: exact scaling
    smoothed = SmoothedWeight(Int4Weight(w), w, s).mm(x)
    assert _err(smoothed, want) < 0.5 * _err(plain, want), (_err(smoothed, want),
                                                            _err(plain, want))


def test_few_rows_keep_the_weight_only_kernel_exactly():
    x, w = _outlier_batch()
    base = Int4Weight(w)
    sw = SmoothedWeight(base, w, smoothing(w, x.float().abs().amax(0)))
    few = x[:quant.A8_MIN_ROWS - 1]
    assert torch.equal(sw.mm(few), base.mm(few))
    assert sw.nbytes == base.nbytes and torch.equal(sw.dequantize(), base.dequantize())


def test_config_needs_act_int8():
    with pytest.raises(ValueError, match="act_int8"):
        EngineConfig(model="x", quantize="int4", smoothquant=True)
    with pytest.raises(ValueError, match="act_int8"):
        EngineConfig(model="x", act_int8=True, smoothquant=True)


def test_engine_calibrates_every_layer_and_salts_its_kv(tiny_target, tiny_prompts):
    base = dict(model=str(tiny_target), num_blocks=128, quantize="int4", act_int8=True)
    sq = LLMEngine(EngineConfig(**base, smoothquant=True))
    a8 = LLMEngine(EngineConfig(**base))
    for L in sq.model.layers:
        assert isinstance(L.qkv_w, SmoothedWeight) and isinstance(L.down_w, SmoothedWeight)
        assert not torch.all(L.down_w.inv == 1)                # calibrated, not identity
    assert sq.cache_salt != a8.cache_salt     # its KV is not another engine's prefix hit
    again = LLMEngine(EngineConfig(**base, smoothquant=True))
    assert all(torch.equal(x.qkv_w.inv, y.qkv_w.inv) and torch.equal(x.down_w.i8.q, y.down_w.i8.q)
               for x, y in zip(sq.model.layers, again.model.layers))
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(EngineConfig(**base, smoothquant=True), tokenizer=None)


def _perplexity(eng: LLMEngine, ids: list[int]) -> float:
    meta, kv = one_prompt(eng.model_cfg, len(ids) - 1, eng.cfg.torch_dtype, every_row=True)
    logits = eng.model.forward(torch.tensor(ids[:-1]), meta, kv)
    return float(torch.exp(F.cross_entropy(logits.float(), torch.tensor(ids[1:]))))


def test_smoothing_is_what_makes_w8a8_accurate_on_smollm2(smollm2, monkeypatch):
    """Perplexity on held-out prose (not the calibration text), 512 tokens: SmoothQuant's
    q|k|v and down on W8A8 stay within 2% of act_int8 (those two on the weight-only
    kernel); the same two on W8A8 without smoothing (s = 1) do measurably worse."""
    from pydoc_data.topics import topics

    base = dict(model=str(smollm2), dtype="bfloat16", num_blocks=64, quantize="int4",
                act_int8=True, max_num_batched_tokens=512, chunk_size=512)
    a8 = LLMEngine(EngineConfig(**base))
    sq = LLMEngine(EngineConfig(**base, smoothquant=True), tokenizer=a8.tokenizer)
    monkeypatch.setattr(model_mod, "smoothing", lambda w, amax: torch.ones(w.shape[1]))
    unsmoothed = LLMEngine(EngineConfig(**base, smoothquant=True), tokenizer=a8.tokenizer)
    text = "\n\n".join(topics[k] for k in sorted(topics)[:10])
    ids = a8.tokenizer.encode(text)[:513]
    ppl = {name: _perplexity(e, ids) for name, e in
           (("a8", a8), ("sq", sq), ("unsmoothed", unsmoothed))}
    assert ppl["sq"] < 1.02 * ppl["a8"], ppl
    assert ppl["unsmoothed"] > 1.01 * ppl["sq"], ppl
