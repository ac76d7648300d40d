"""Cache-aware routing: a prompt goes where its prefix was last sent, unless that
instance is much busier than the least loaded one."""
from __future__ import annotations

from services.gateway.affinity import PrefixAffinity
from services.gateway.registry import Registry
from shared.contracts.messages import Heartbeat


def _reg(loads: dict[str, int]) -> Registry:
    reg = Registry(dead_after_s=5.0)
    for iid, running in loads.items():
        reg.observe(Heartbeat(service="decode", instance_id=iid, running=running), now=0.0)
    return reg


def test_longest_leading_prefix_per_instance():
    aff = PrefixAffinity(granularity=4)
    a = list(range(100, 140))
    aff.record(a[:24], "d_0")
    aff.record(a[:8] + [1] * 16, "d_1")      # shares two pieces with a, then diverges
    assert aff.best(a) == {"d_1": 8, "d_0": 24}  # d_1 owns the first two pieces now
    assert aff.best([5] * 40) == {}
    aff.forget("d_0")
    assert aff.best(a) == {"d_1": 8}


def test_bounded_size():
    aff = PrefixAffinity(granularity=2, max_entries=10)
    for i in range(20):
        aff.record([i] * 20, "d_0")
    assert len(aff) == 10


def test_choose_prefers_the_warm_instance_within_the_load_slack():
    reg = _reg({"d_0": 0, "d_1": 3})
    assert reg.choose(1.0) == "d_0"
    assert reg.choose(1.0, cached={"d_1": 512}) == "d_1"               # 3 <= 0 + 4
    assert reg.choose(1.0, cached={"d_1": 100}) == "d_0"               # too little cached
    busy = _reg({"d_0": 0, "d_1": 9})
    assert busy.choose(1.0, cached={"d_1": 4096}) == "d_0"             # balance wins
    assert reg.choose(1.0, exclude={"d_1"}, cached={"d_1": 512}) == "d_0"
