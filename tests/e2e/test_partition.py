"""A partition across a real link (issue 30): `pdmesh up` on this host (nats-server listening
for other hosts: --nats-host 0.0.0.0), and a second decode on its own "host", a network
namespace with its own hostname and /dev/shm, reached over a veth pair, started as an
operator adds one by hand (decode-0's command line, its NATS user, another instance id).
16 greedy streams of 200 tokens; once each has 3 tokens, the decode host's link drops every
packet for 8 s (the gateway declares it lost after 5 s of silence), then heals.

Every request completes with its uninterrupted reference's tokens (the gateway migrates the
cut-off decode's streams; before deterministic mode attended each row as its own decode step,
1-2 of 16 migrated streams came back different), the mesh serves on both decodes again after
the heal, and the partitioned decode holds no block once the migrated requests are gone.
A minority partition of NATS: the node the gateway is connected to cut off (its client
and route ports) for 8 s under the same load; no request fails and none changes (services
leave a silent server after 3 s of unanswered PINGs; at nats-py's default, 2 min x 2, the
gateway stayed on the cut node and took every decode for dead).

Root only (network namespaces); skipped with the reason elsewhere.
"""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from pdmesh.chaos import netlab
from pdmesh.chaos.faultload import Load, metric, references
from pdmesh.local.launched import UpMesh
from shared import micro
from tests.conftest import TINY_TARGET

MAX_TOKENS = 200
CUT_S = 8.0     # past the gateway's 5 s heartbeat silence: decode_b's streams do migrate
WHY = netlab.reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network lab: {WHY}")


@pytest.fixture(scope="module")
def lab():
    with netlab.NetLab() as lab:
        yield lab


@pytest.fixture(scope="module")
def mesh(lab):
    loop = asyncio.new_event_loop()
    # the references are the engine's greedy 200 tokens; the tiny model loops in 3 of the
    # 16 (a 2-token span past token ~130), which the repetition rule would cut (and cut
    # elsewhere after a migration, whose new instance judges afresh): off for this test
    m = UpMesh("--model", str(TINY_TARGET), "--deterministic", "--nats-host", "0.0.0.0",
               "--nats-cluster", "3", "--set", "decode.monitor_repeat_window=0")
    host = lab.host("b")
    proc = None
    try:
        loop.run_until_complete(m.start())
        proc = m.spawn_like("decode-0", "decode_b", nats_host=host.peer, wrap=host.command)
        try:
            loop.run_until_complete(_decodes(m, 2, 240))
        except TimeoutError as e:       # once in a fresh-clone full run: say why
            log = (m.run_dir / "decode_b.log").read_text(errors="replace")[-3000:]
            raise TimeoutError(f"{e}\ndecode_b (exit {proc.poll()}):\n{log}") from None
        yield m, loop, host
    finally:
        host.heal()
        if proc is not None:
            proc.kill()
            proc.wait()
        loop.run_until_complete(m.stop())
        loop.close()


@pytest.fixture(scope="module")
def refs(mesh, tiny_prompts):
    from services.decode.config import DecodeConfig
    from shared.settings import load

    m, _, _ = mesh
    argv = Path(f"/proc/{m.pid('decode-0')}/cmdline").read_bytes().split(b"\0")
    engine = load(DecodeConfig, [a.decode() for a in argv if a][3:]).engine
    return references(engine, tiny_prompts[:16], MAX_TOKENS)


async def _decodes(m: UpMesh, n: int, timeout_s: float) -> float:
    """Seconds until the gateway counts n live decode instances."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(m.url + "/ready") as r:
                if (await r.json()).get("decode_instances") == n:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not {n} decode instances in {timeout_s} s:\n{m.tail(30)}")
            await asyncio.sleep(0.2)


async def _blocks_used(m: UpMesh, instance: str) -> int:
    nc = await m.nats()
    try:
        found = [i for i in await micro.stats(nc, "decode", 0.5) if i.instance_id == instance]
    finally:
        await nc.close()
    return found[0].stats["blocks_used"] if found else -1


def test_a_partition_of_a_decode_host_changes_no_answer(mesh, refs, tiny_prompts):
    m, loop, host = mesh

    async def scenario() -> tuple[Load, float, float]:
        migrated0 = await metric(m.url, "pdmesh_migrations_total")
        load = Load(m.url, tiny_prompts[:16], "tiny-target", MAX_TOKENS)
        runner = asyncio.ensure_future(load.run(16))
        await load.mid_stream(streams=16, tokens=3)       # every migrated stream resumes
        host.cut()
        await asyncio.sleep(CUT_S)
        host.heal()
        await runner
        back_s = await _decodes(m, 2, 60)
        return load, back_s, await metric(m.url, "pdmesh_migrations_total") - migrated0

    load, back_s, migrated = loop.run_until_complete(scenario())
    print(f"partition: {migrated:.0f} streams migrated; both decodes serve {back_s:.1f} s "
          "after the streams ended")
    assert load.failed() == [], f"{load.failed()[:3]}\n{m.tail(80)}"
    assert load.wrong(refs) == [], f"outputs differ from the uninterrupted ones: {load.wrong(refs)}"
    assert migrated > 0, "the cut decode's streams were not migrated: the test proved nothing"

    async def after() -> tuple[Load, int]:
        again = Load(m.url, tiny_prompts[:16], "tiny-target", 32)     # the mesh serves again
        await again.run(16)
        deadline = time.monotonic() + 30
        while (used := await _blocks_used(m, "decode_b")) != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return again, used

    again, used = loop.run_until_complete(after())
    assert again.failed() == [], again.failed()[:3]
    assert again.wrong([r[:32] for r in refs]) == []
    assert used == 0, f"decode_b still holds {used} blocks after the heal"


def _nats_node_of(m: UpMesh, child: str) -> tuple[str, list[int]]:
    """The nats-server child's name that `child` is connected to, and its client and route
    ports (from the node's config file)."""
    pid = m.pid(child)
    out = subprocess.run(["ss", "-Htnp", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    peers = {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines()
             if f"pid={pid}," in line}
    for name in ("nats-0", "nats-1", "nats-2"):
        ports = m.nats_node_ports(name)
        if ports[0] in peers:
            return name, ports
    raise AssertionError(f"{child} (pid {pid}) is connected to no nats-server: {peers}")


def test_the_gateways_nats_node_cut_off_costs_no_request(mesh, refs, tiny_prompts):
    m, loop, _ = mesh
    node, ports = _nats_node_of(m, m.gateway_name())
    cut = netlab.PortCut(ports, "gw")

    async def scenario() -> Load:
        load = Load(m.url, tiny_prompts[:16], "tiny-target", MAX_TOKENS)
        runner = asyncio.ensure_future(load.run(16))
        await load.mid_stream(streams=16, tokens=3)
        cut.cut()
        try:
            await asyncio.sleep(CUT_S)
        finally:
            cut.heal()
        await runner
        await _decodes(m, 2, 60)
        return load

    load = loop.run_until_complete(scenario())
    assert load.failed() == [], f"{node}: {load.failed()[:3]}\n{m.tail(80)}"
    assert load.wrong(refs) == [], f"outputs differ from the uninterrupted ones: {load.wrong(refs)}"
