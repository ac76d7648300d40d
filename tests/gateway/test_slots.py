"""The gateway's in-flight accounting (services/gateway/slowclients.py): a global cap and
a per-key cap, so one API key cannot hold every slot; the open gateway's anonymous key is
held to the global cap only."""
from __future__ import annotations

import pytest

from services.gateway.protocol import OpenAIError
from services.gateway.slowclients import Slots, key_cap


def test_one_key_is_held_to_its_own_cap_and_others_still_get_in():
    s = Slots()
    cap = 8
    for _ in range(key_cap(cap, 0)):                  # half the cap: 4
        s.take("a", cap, key_cap(cap, 0))
    with pytest.raises(OpenAIError) as e:
        s.take("a", cap, key_cap(cap, 0))
    assert e.value.status == 429 and "per key" in str(e.value)
    for _ in range(4):
        s.take("b", cap, key_cap(cap, 0))
    with pytest.raises(OpenAIError) as e:             # now the global cap
        s.take("c", cap, key_cap(cap, 0))
    assert "limit 8)" in str(e.value)
    s.give("a")
    s.take("c", cap, key_cap(cap, 0))
    assert (s.total, dict(s.by_key)) == (8, {"a": 3, "b": 4, "c": 1})


def test_the_anonymous_key_and_explicit_caps():
    s = Slots()
    for _ in range(8):
        s.take("", 8, key_cap(8, 0))                  # no API keys: the global cap only
    with pytest.raises(OpenAIError):
        s.take("", 8, key_cap(8, 0))
    for _ in range(8):
        s.give("")
    assert s.total == 0 and not s.by_key
    assert key_cap(8, 3) == 3 and key_cap(1, 0) == 1 and key_cap(0, 0) == 0
