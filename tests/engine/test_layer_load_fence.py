"""A lower tier's loader writes from its own thread (LayerSplit's worker) while the
engine's owner frees the request: once LayerLoad.cancel() returned, no copy is running
and none lands, so the freed blocks can go to another request (layer_load.py)."""
from __future__ import annotations

import threading

from shared.engine.layer_load import LayerLoad


def test_cancel_waits_for_the_copy_in_progress_and_stops_the_next():
    ld = LayerLoad("r", num_layers=2, blocks=[3, 4], keys=[b"a", b"b"], first_block=0)
    copying, finish, log = threading.Event(), threading.Event(), []

    def slow_copy():
        copying.set()
        assert finish.wait(10)
        log.append("copied")
    loader = threading.Thread(target=lambda: log.append(ld.land(slow_copy)))
    loader.start()
    assert copying.wait(10)
    canceller = threading.Thread(target=lambda: (ld.cancel(), log.append("cancelled")))
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive(), "cancel() returned while a copy was writing the blocks"
    finish.set()
    loader.join(10)
    canceller.join(10)
    assert log == ["copied", True, "cancelled"]
    assert ld.land(lambda: log.append("late")) is False and "late" not in log
