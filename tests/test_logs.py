"""shared/logs.py: a JSON line is one object with the fields an operator searches by, and
the engine loop's throughput line (shared/engine_loop.Throughput) says what it did."""
from __future__ import annotations

import json
import logging

from shared import logs
from shared.engine_loop import Throughput


def record(msg: str, **fields) -> logging.LogRecord:
    r = logging.LogRecord("pdmesh.test", logging.WARNING, __file__, 1, msg, (), None)
    if fields:
        r.fields = fields
    return r


def test_a_json_line_names_service_instance_and_request():
    logs.set_identity("decode", "decode_host_abc")
    fmt = logs.JsonFormatter()
    with logs.request_context("chatcmpl-1"):
        line = json.loads(fmt.format(record("slow write", blocks=3)))
    assert line["service"] == "decode" and line["instance"] == "decode_host_abc"
    assert line["level"] == "warning" and line["message"] == "slow write"
    assert line["request_id"] == "chatcmpl-1" and line["blocks"] == 3
    assert line["time"].endswith("Z")
    assert "request_id" not in json.loads(fmt.format(record("outside")))


def test_an_exception_travels_in_one_line():
    try:
        raise ValueError("bad")
    except ValueError:
        import sys
        r = logging.LogRecord("pdmesh.test", logging.ERROR, __file__, 1, "failed", (),
                              sys.exc_info())
    text = logs.JsonFormatter().format(r)
    assert "\n" not in text and "ValueError: bad" in json.loads(text)["exc"]


class FakeEngine:
    def __init__(self):
        self.counters = {"prompt_tokens": 100}
        self.st = {"running": 2, "waiting": 1, "blocks_used": 25, "blocks_total": 100,
                   "prompt_tokens": 100}

    def stats(self):
        return self.st


class Out:
    def __init__(self, n):
        self.new_token_ids = [0] * n


def test_the_throughput_line_counts_tokens_per_second_and_stays_quiet_when_idle():
    now = [0.0]
    eng = FakeEngine()
    tp = Throughput(eng, every_s=10, clock=lambda: now[0])
    tp.add([Out(1), Out(3)])
    now[0] = 5
    assert tp.line() is None                      # not yet due
    eng.st["prompt_tokens"] = 300
    tp.add([Out(16)])
    now[0] = 10
    assert tp.line() == {"running": 2, "waiting": 1, "prompt_tok_s": 20.0,
                         "generation_tok_s": 2.0, "kv_usage": 0.25}
    eng.st.update(running=0, waiting=0)
    now[0] = 20
    assert tp.line() is None                      # nothing happened: no line
    tp.add([Out(6)])
    now[0] = 22
    assert tp.line() is None                      # not due, still busy
    assert tp.line(idle=True)["generation_tok_s"] == 3.0     # out of work: said at once
    now[0] = 23
    assert tp.line(idle=True) is None             # and only once
