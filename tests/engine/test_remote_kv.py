"""Remote KV on the decode side (services/decode/slots.py over the engine's held
sequences): the epoch fence, and blocks kept out of the pool until released."""
from __future__ import annotations

import pytest

from services.decode.slots import KvSlots
from shared.contracts.constraint import Constraint, ConstraintKind
from shared.contracts.kv import KvWrite
from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.grammar import ReplayError
from shared.kv import wire

P = SamplingParams(temperature=0.0, max_tokens=4)


def slots(model, device: str, fence: bool = True, **kw) -> KvSlots:
    eng = LLMEngine(EngineConfig(model=str(model), num_blocks=8, block_size=16, device=device,
                                 **kw), tokenizer=None)
    return KvSlots(eng, epoch_fence=fence)


def write(s: KvSlots, blocks: list[int], epochs: list[int]) -> KvWrite:
    """A one-layer write of zeros into these blocks."""
    kv = s.engine.kv
    shape = [1, 2, len(blocks), *kv.shape[3:]]
    return KvWrite(request_id="x", epochs=epochs, block_ids=blocks, layer_start=0, layer_end=1,
                   dtype=wire.dtype_name(kv.dtype), shape=shape, seq=0, sender="p")


def test_fence_refuses_a_write_whose_blocks_moved_on(tiny_target, device):
    s = slots(tiny_target, device)
    a = s.reserve("a", list(range(20)), P)
    assert s.write(write(s, a.dest, a.epochs), _zeros(s, a.dest))
    s.drop("a", keep_blocks=False)
    b = s.reserve("b", list(range(20)) * 6, P)
    assert set(a.dest) & set(b.dest)                             # a's blocks went to b
    assert not s.write(write(s, a.dest, a.epochs), _zeros(s, a.dest))   # a's late write
    assert s.write(write(s, b.dest, b.epochs), _zeros(s, b.dest))
    assert not s.write(write(s, [99], [1]), _zeros(s, [0]))      # not a block of this pool


def test_fence_switched_off_lets_every_write_land(tiny_target, device):
    s = slots(tiny_target, device, fence=False)
    a = s.reserve("a", list(range(20)), P)
    s.drop("a", keep_blocks=False)
    s.reserve("b", list(range(20)) * 6, P)
    assert s.write(write(s, a.dest, a.epochs), _zeros(s, a.dest))   # TEST ONLY: unfenced


def test_kept_blocks_are_never_handed_out_until_released(tiny_target, device):
    s = slots(tiny_target, device)
    a = s.reserve("a", list(range(60)), P)                     # 4 of 8 blocks
    s.drop("a", keep_blocks=True)
    assert s.engine.pool.num_free == 4 and "a" not in s.engine.requests
    b = s.reserve("b", list(range(60)), P)
    assert not set(b.held) & set(a.held)
    s.drop("b", keep_blocks=False)
    s.release(a.held)
    assert s.engine.pool.num_used == 0


def test_fallback_can_keep_the_reserved_blocks_out_of_the_pool(tiny_target, device):
    s = slots(tiny_target, device)
    a = s.reserve("a", list(range(20)), P)
    s.fallback("a", keep_blocks=True)
    while s.engine.has_unfinished:
        s.engine.step()
    assert s.engine.pool.num_used == len(a.held)
    s.release(a.held)
    assert s.engine.pool.num_used == 0


def test_start_seals_the_blocks_against_late_writes(tiny_target, device):
    s = slots(tiny_target, device)
    a = s.reserve("a", list(range(20)), P)
    s.start("a", 5)
    assert not s.write(write(s, a.dest, a.epochs), _zeros(s, a.dest))


def test_first_token_outside_the_grammar_is_refused_not_guessed(tiny_target, device):
    """Prefill sampled a first token decode's grammar forbids (a dropped constraint):
    start raises ReplayError and the request is gone — never decoded on."""
    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=64, device=device))
    s = KvSlots(eng)
    c = Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema='{"type":"object"}')
    s.reserve("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), c)
    not_json = eng.tokenizer.encode("hello")[0]
    with pytest.raises(ReplayError):
        s.start("r", not_json)
    assert "r" not in eng.requests and not eng.has_unfinished


def _zeros(s: KvSlots, blocks: list[int]) -> bytes:
    kv = s.engine.kv
    return bytes(kv[:1, :, :len(blocks)].numel() * kv.element_size())
