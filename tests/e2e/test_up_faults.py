"""The product survives its own faults: `pdmesh up` itself (a subprocess, found through its run
record, as a user launches it), under 16 concurrent greedy streams, with an operator's
`kill -9` of one child or `pdmesh restart SERVICE`. Each fault: no request fails, every output
equals the engine alone's (deterministic mode), and a killed child is back and the mesh ready
within 60 s (issue 28). One mesh for the module: 2 prefill, 2 decode, 3 clustered nats-servers,
NATS auth on (the default).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pdmesh.chaos.faultload import Load, references, sample as _sample
from pdmesh.local.launched import UpMesh
from shared import micro
from tests.conftest import TINY_TARGET

MAX_TOKENS = 48
FLAGS = ("--model", str(TINY_TARGET), "--prefill", "2", "--decode", "2", "--nats-cluster", "3",
         "--deterministic", "--dtype", "float32",
         # every prompt through prefill (the tiny prompts are under the default 1000): the
         # faults under test are those of the PD path
         "--min-pd-prompt-tokens", "0",
         # a draining decode hands every request on at once: a rolling restart migrates them
         "--set", "decode.drain_timeout_s=0",
         # slow KV writes, so that a prefill can be caught with writes on the wire
         "--set", "prefill.fault_kv_write_delay_s=0.02", "--set", "prefill.kv_max_write_bytes=16384")


@pytest.fixture(scope="module")
def up():
    loop = asyncio.new_event_loop()
    m = UpMesh(*FLAGS)
    try:
        loop.run_until_complete(m.start())
    except BaseException:
        loop.run_until_complete(m.stop())
        loop.close()
        raise
    yield m, loop
    code = loop.run_until_complete(m.stop())
    loop.close()
    assert code == 0, m.tail(40)                    # Ctrl-C / SIGTERM: a clean stop
    assert not (m.run_dir / f"up-{m.proc.pid}.json").exists()   # its run record is gone


@pytest.fixture(scope="module")
def alone(up):
    """The engine alone's settings, from decode-0's own command line (the mesh's)."""
    from services.decode.config import DecodeConfig
    from shared.settings import load

    m, _ = up
    argv = Path(f"/proc/{m.pid('decode-0')}/cmdline").read_bytes().split(b"\0")
    flags = [a.decode() for a in argv if a][3:]       # python -m services.decode FLAGS
    engine = load(DecodeConfig, flags).engine
    engine.threads = 1
    return engine


@pytest.fixture(scope="module")
def refs(alone, tiny_prompts):
    return references(alone, tiny_prompts, MAX_TOKENS)


def run(up, coro):
    return up[1].run_until_complete(asyncio.wait_for(coro, 300))


async def under_load(m: UpMesh, prompts, fault, n: int = 32, through: bool = False
                     ) -> Load:
    """n greedy streams, 16 at a time; fault(load) runs beside them. through: streams go
    on being sent until the fault is over (a rolling restart's CLI can start after n
    short streams have all ended: no drain would then meet one)."""
    load = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
    faulted = asyncio.ensure_future(fault(load))
    runner = asyncio.ensure_future(load.run(n, until=faulted if through else None))
    try:
        await faulted
    finally:
        await runner
    return load


def check(load: Load, refs, m: UpMesh, n: int = 32) -> None:
    assert len(load.results) >= n                   # every request sent came back
    assert sorted(r["i"] for r in load.results) == list(range(len(load.results)))
    assert load.failed() == [], (load.failed()[:3], m.tail(40))
    assert load.wrong(refs) == [], m.tail(20)


def kill_then_back(m: UpMesh, name: str):
    async def fault(load: Load) -> None:
        await load.mid_stream()
        old = m.sigkill(name)
        recovered = await m.back(name, old, timeout_s=60)
        assert recovered < 60
    return fault


def test_sigkill_of_a_decode_mid_stream_costs_no_request(up, refs, tiny_prompts):
    """Its streams move at once: the decode back under its id within a second is a new
    process (its heartbeat's incarnation), not progress_timeout_s (60 s) later."""
    m, _ = up
    stalled = 'pdmesh_migrations_total{reason="no_progress"}'
    before = _sample(run(up, m.metrics()), stalled)
    load = run(up, under_load(m, tiny_prompts, kill_then_back(m, "decode-1")))
    check(load, refs, m)
    assert "decode-1 exited with code -9; starting it again" in m.tail(400)
    text = run(up, m.metrics())
    assert _sample(text, 'pdmesh_migrations_total{reason="instance_restarted"}') + _sample(
        text, 'pdmesh_migrations_total{reason="instance_dead"}') > 0
    assert _sample(text, stalled) == before


def test_sigkill_of_a_prefill_with_kv_writes_on_the_wire_costs_no_request(up, refs, tiny_prompts):
    m, _ = up

    async def fault(load: Load) -> None:
        nc = await m.nats()
        deadline = time.monotonic() + 60
        try:   # proven in flight: prefill-0 has KV writes on the wire right now
            while True:
                mine = [i.stats for i in await micro.stats(nc, "prefill", 0.05)
                        if i.instance_id == "prefill_0"]
                if mine and mine[0].get("kv_writes_in_flight", 0) > 0:
                    break
                assert time.monotonic() < deadline, "prefill-0 never had a write in flight"
        finally:
            await nc.close()
        old = m.sigkill("prefill-0")
        assert await m.back("prefill-0", old, timeout_s=60) < 60

    # enough requests that jobs keep coming until a write is caught on the wire
    check(run(up, under_load(m, tiny_prompts, fault, n=96)), refs, m, n=96)


def test_sigkill_of_a_nats_node_costs_no_request(up, refs, tiny_prompts):
    m, _ = up
    check(run(up, under_load(m, tiny_prompts, kill_then_back(m, "nats-1"))), refs, m)


@pytest.mark.parametrize("service", ["decode", "prefill", "kvstore", "gateway", "nats"])
def test_rolling_restart_under_load_costs_no_request(up, refs, tiny_prompts, service):
    m, _ = up

    handed_on = 'pdmesh_migrations_total{reason="instance_shutdown"}'
    before = _sample(run(up, m.metrics()), handed_on)

    async def fault(load: Load) -> None:
        await load.mid_stream()
        code, out = await m.restart(service)
        assert code == 0, out
        assert "rolling restart done" in out

    load = run(up, under_load(m, tiny_prompts, fault, through=True))
    check(load, refs, m)
    if service == "decode":    # drain_timeout_s=0: the streams of each drained decode moved
        assert _sample(run(up, m.metrics()), handed_on) > before


def test_a_frozen_kvstore_costs_no_request(up, alone, tiny_prompts):
    """kill -STOP of the kvstore (its host stops answering: a long pause, a partition). Every
    PD submission's cache lookup then waits kvstore_timeout_s (2 s) for nothing. Decode took
    submissions one at a time, so a burst's waits added up past the gateway's
    submit_timeout_s (5 s): 16 concurrent requests, 8 per decode, and all but the first
    two of each failed 503 no_decode_instance. Each waits on its own now, and after the
    first timeouts the lookups miss at once (a probe every 5 s) until kvstore answers."""
    m, _ = up
    # 16 prompts of 272 tokens: one whole chunk each (deterministic mode looks up no less)
    prompts = [(p * 300)[:272] for p in tiny_prompts[:16]]
    refs = references(alone, prompts, MAX_TOKENS)
    before = run(up, _lookups(m))
    pid = m.pid("kvstore-0")
    os.kill(pid, signal.SIGSTOP)
    try:
        load = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
        run(up, load.run(32))
    finally:
        os.kill(pid, signal.SIGCONT)
    check(load, refs, m)
    assert m.pid("kvstore-0") == pid                 # frozen, not taken for dead
    # silent after the first timeouts: most lookups were skipped, not waited out
    frozen = run(up, _lookups(m))
    assert frozen["kv_lookups_skipped"] > before["kv_lookups_skipped"]

    async def answered_again() -> Load:  # thawed: a probe gets its answer, lookups go on
        for _ in range(60):
            again = Load(m.url, prompts, "tiny-target", MAX_TOKENS)
            await again.run(2)
            now = await _lookups(m)
            if now["kv_lookups"] - now["kv_lookup_errors"] > (
                    frozen["kv_lookups"] - frozen["kv_lookup_errors"]):
                return again
            await asyncio.sleep(0.5)
        raise AssertionError(f"no lookup answered after the thaw: {now}")
    check(run(up, answered_again()), refs, m, n=2)


async def _lookups(m: UpMesh) -> dict[str, int]:
    """Decode's kvstore lookup counters, summed over its instances."""
    nc = await m.nats()
    try:
        found = await micro.stats(nc, "decode", 0.5)
    finally:
        await nc.close()
    keys = ("kv_lookups", "kv_lookup_errors", "kv_lookups_skipped")
    return {k: sum(i.stats.get(k, 0) for i in found) for k in keys}


def test_status_finds_the_mesh_with_no_flags_and_no_secret_is_shown(up):
    m, _ = up
    for _ in range(2):                                        # /metrics reads $SRV.STATS
        assert "pdmesh_requests_in_flight" in run(up, m.metrics())
    code, out = run(up, m.cli("status"))
    assert code == 0, out
    for service in ("gateway", "decode", "prefill", "kvstore"):
        assert service in out
    pw = Path(m.record()["nats_password_file"]).read_text().strip()
    assert pw not in "\n".join(m.lines)                      # never printed
    assert "permissions violation" not in "\n".join(m.lines)


def test_sigkill_of_the_gateway_it_comes_back_and_serves(up, refs, tiny_prompts):
    """Streams on a killed gateway die with its sockets (nothing can answer them); the
    supervisor starts it again on the same port and the next requests are correct."""
    m, _ = up

    async def go() -> Load:
        old = m.sigkill(m.gateway_name())
        await m.back(m.gateway_name(), old, timeout_s=60)
        load = Load(m.url, tiny_prompts, "tiny-target", MAX_TOKENS)
        await load.run(16)
        return load
    load = run(up, go())
    assert len(load.results) == 16
    assert load.failed() == [] and load.wrong(refs) == []
