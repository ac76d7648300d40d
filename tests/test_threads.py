"""--threads auto: the host's cores divided among the engine instances pdmesh up starts."""
import pytest

from pdmesh.local.cluster import Cluster
from pdmesh.local.threads import parse_threads, resolve_threads, split_cores


@pytest.mark.parametrize("cores,prefill,decode,want", [
    (2, 1, 1, {"prefill": [1], "decode": [1]}),
    (16, 1, 1, {"prefill": [8], "decode": [8]}),
    (7, 1, 2, {"prefill": [2], "decode": [3, 2]}),      # the remainder to decode first
    (2, 2, 2, {"prefill": [1, 1], "decode": [1, 1]}),   # never fewer than one each
    (16, 0, 1, {"prefill": [], "decode": [16]}),
])
def test_split_cores(cores, prefill, decode, want):
    got = split_cores(cores, prefill, decode)
    assert got == want
    assert sum(got["prefill"] + got["decode"]) <= max(cores, prefill + decode)


def test_resolve_and_parse():
    assert resolve_threads(3, 1, 1) == {}
    assert resolve_threads("auto", 1, 2, cores=8) == {"decode-0": 3, "decode-1": 3,
                                                      "prefill-0": 2}
    assert parse_threads("auto") == "auto" and parse_threads("4") == 4
    with pytest.raises(ValueError):
        parse_threads("-1")


def test_cluster_auto_threads_are_explicit_numbers_per_instance(tiny_target):
    c = Cluster(str(tiny_target), prefill=1, decode=2, threads="auto", echo=False)
    n = {k: v["threads"] for k, v in c.instance_settings.items() if "threads" in v}
    assert set(n) == {"prefill-0", "decode-0", "decode-1"}
    assert all(isinstance(t, int) and t >= 1 for t in n.values())
    assert c.settings["decode"]["threads"] is None
    # an explicit per-instance setting wins
    c = Cluster(str(tiny_target), threads="auto", echo=False,
                overrides={"decode-0": {"threads": 5}})
    assert c.instance_settings["decode-0"]["threads"] == 5
