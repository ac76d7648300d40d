"""Remote KV on the decode side: the epoch fence, and quarantined blocks that are never
handed out until released."""
from __future__ import annotations

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine

P = SamplingParams(temperature=0.0, max_tokens=4)


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=8, block_size=16, **kw),
                     tokenizer=None)


def test_fence_refuses_a_write_whose_blocks_moved_on(tiny_target):
    eng = engine(tiny_target)
    blocks, epochs, _, _ = eng.reserve_remote("a", list(range(20)), P)
    assert eng.accept_kv(blocks, epochs)
    eng.abort("a")
    blocks_b, epochs_b, _, _ = eng.reserve_remote("b", list(range(20)) * 6, P)
    assert set(blocks) & set(blocks_b)            # a's blocks went to b
    assert not eng.accept_kv(blocks, epochs)      # a's late write is fenced
    assert eng.accept_kv(blocks_b, epochs_b)
    assert not eng.accept_kv([99], [1])           # not a block of this pool


def test_fence_switched_off_lets_every_write_land(tiny_target):
    eng = engine(tiny_target, epoch_fence=False)
    blocks, epochs, _, _ = eng.reserve_remote("a", list(range(20)), P)
    eng.abort("a")
    eng.reserve_remote("b", list(range(20)) * 6, P)
    assert eng.accept_kv(blocks, epochs)          # TEST ONLY: the unfenced system


def test_quarantined_blocks_are_never_handed_out_until_released(tiny_target):
    eng = engine(tiny_target)
    blocks, _, _, _ = eng.reserve_remote("a", list(range(60)), P)      # 4 of 8 blocks
    eng.abort("a", quarantine=True)
    assert eng.stats()["blocks_quarantined"] == 4 and eng.pool.num_free == 4
    got, _, _, _ = eng.reserve_remote("b", list(range(60)), P)
    assert not set(got) & set(blocks)
    eng.abort("b")
    assert eng.release_quarantined("a") == 4
    assert eng.stats()["blocks_quarantined"] == 0 and eng.pool.num_used == 0


def test_prefill_locally_can_quarantine_the_reserved_blocks(tiny_target):
    eng = engine(tiny_target)
    blocks, _, _, _ = eng.reserve_remote("a", list(range(20)), P)
    eng.prefill_locally("a", quarantine=True)
    assert eng.quarantined["a"] == blocks
    while eng.has_unfinished:
        eng.step()
    eng.release_quarantined("a")
    assert eng.pool.num_used == 0


def test_first_token_outside_the_grammar_is_refused_not_guessed(tiny_target):
    """Prefill sampled a first token decode's grammar forbids (a dropped constraint):
    start_remote raises ReplayError and the request is gone — never decoded on."""
    from shared.contracts.constraint import Constraint, ConstraintKind
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.grammar import ReplayError
    import pytest

    eng = LLMEngine(EngineConfig(model=str(tiny_target), num_blocks=64))
    c = Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema='{"type":"object"}')
    eng.reserve_remote("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), c)
    not_json = eng.tokenizer.encode("hello")[0]
    with pytest.raises(ReplayError):
        eng.start_remote("r", not_json)
    assert "r" not in eng.requests and not eng.has_unfinished
