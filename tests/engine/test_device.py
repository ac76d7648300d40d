"""The engine on each device (EngineConfig.device): weights, KV pool and forward there,
logits back on the host; the same greedy tokens as on the CPU, a prefix-cache hit and KV
moved through the wire (pack from one pool, unpack into another) on the device too.
`device` is tests/devices.py's fixture: CUDA cases skip without a GPU."""
from __future__ import annotations

import pytest

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.kv import wire


@pytest.fixture(scope="module")
def cpu_engine(tiny_target):
    return LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256))


def test_device_setting_is_checked():
    with pytest.raises(ValueError):
        EngineConfig(model="x", device="tpu")


@pytest.mark.parametrize("quantize", ["", "int8"])
def test_engine_on_device_matches_cpu(tiny_target, tiny_prompts, cpu_engine, device, quantize):
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=256, device=device,
                                 quantize=quantize))
    assert eng.kv.device.type == device and eng.model.embed.device.type == device
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = tiny_prompts[:4]
    got = [r["token_ids"] for r in eng.generate(prompts, p)]
    ref = cpu_engine if not quantize else LLMEngine(EngineConfig(
        model=str(tiny_target), num_blocks=256, quantize=quantize))
    want = [r["token_ids"] for r in ref.generate(prompts, p)]
    assert sum(a[:4] == b[:4] for a, b in zip(got, want)) >= len(prompts) - 1
    long = (tiny_prompts[0] * 8)[:40]
    once = eng.generate([long], p)[0]["token_ids"]
    assert eng.generate([long], p)[0]["token_ids"] == once            # an L1 prefix hit
    assert eng.stats()["prefix_hit_tokens"] > 0


def test_kv_moves_between_pools_on_device(tiny_target, tiny_prompts, device):
    cfg = dict(model=str(tiny_target), num_blocks=64, device=device, deterministic=True,
               max_num_batched_tokens=64, chunk_size=32)
    a, b = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))
    prompt = (tiny_prompts[0] * 8)[:40]
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a.add_request("x", prompt, p, prefill_only=True)
    outs = []
    while a.has_unfinished:
        outs += a.step()
    first = outs[-1].new_token_ids[0]
    src = a.port.kept_blocks("x")
    seq, _ = b.port.hold("y", prompt, p)
    payload, shape = wire.pack(a.kv, src, 0, a.kv.shape[0])
    wire.unpack_into(b.kv, seq.block_table[:len(src)], 0, b.kv.shape[0], payload,
                     wire.dtype_name(b.kv.dtype), shape)
    out = [b.port.resume("y", first).new_token_ids[0]]
    while b.has_unfinished:
        out += [t for o in b.step() for t in o.new_token_ids]
    alone = LLMEngine(EngineConfig(**cfg)).generate([prompt], p)[0]["token_ids"]
    assert out == alone
