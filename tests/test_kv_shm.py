"""Same-host KV writes through shared memory (shared/kv/shm.py, shm_transport.py): the
segment's allocator, the reader's handles, and against a real nats-server: a write to a
same-host decode carries only a handle and lands exactly as over NATS, a corrupted one is
refused, a decode that cannot read the segment gets NATS from then on, a full segment
falls back to NATS, an unanswered write's region is never reused."""
from __future__ import annotations

import os

import pytest
import torch

from shared import subjects
from shared.contracts.common import ErrorCode
from shared.kv import shm, wire
from shared.kv.nats_transport import SHM_HEADER, NatsKvTransport
from shared.kv.shm_transport import ShmKvTransport
from shared.service import ServiceError, ServiceRuntime
from tests.gateway.conftest import nats_url  # noqa: F401 - the nats-server fixture
from tests.test_kv_transport import Decode, Engine, L, job, pool, sender, write

pytestmark = pytest.mark.skipif(not shm.host_id(), reason="no /dev/shm here")


def test_arena_allocates_frees_and_merges(tmp_path):
    a = shm.Arena(64 << 10, directory=tmp_path)
    assert a.path.exists() and a.path.stat().st_size == 64 << 10
    x, y, z = a.alloc(5000), a.alloc(4096), a.alloc(4096)
    assert (x, y, z) == (0, 8192, 12288)              # page-aligned regions
    assert a.alloc(60 << 10) is None                   # does not fit
    a.free(y)
    assert a.alloc(4096) == 8192                       # first fit reuses it
    for off in (x, 8192, z):
        a.free(off)
    assert a.free_list == [(0, 64 << 10)] and a.bytes_used == 0   # merged back into one
    a.close()
    assert not a.path.exists()


def test_reader_copies_regions_and_refuses_bad_handles(tmp_path):
    a = shm.Arena(16 << 10, directory=tmp_path)
    off = a.alloc(10)
    a.view[off:off + 10] = b"0123456789"
    r = shm.Segments(directory=tmp_path)
    got = r.region(f"{a.name}:{off}:10")
    a.view[off:off + 10] = b"xxxxxxxxxx"
    assert bytes(got) == b"0123456789"               # a copy: the writer cannot change it
    for bad in ("nonsense", f"{a.name}:0:999999", "other-seg:0:1", f"{shm.PREFIX}gone-1:0:1",
                f"../{a.name}:0:1"):
        with pytest.raises(shm.ShmUnavailable):
            r.region(bad)
    r.close()
    a.close()


def test_reader_refuses_what_no_writer_of_ours_made(tmp_path):
    """Issue 29: a symlink named like a segment read whatever it pointed at (a root-only
    file, byte by byte through the digest answers). O_NOFOLLOW, and only a regular 0600
    file of this user with one link is read."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root-only contents")
    secret.chmod(0o600)
    r = shm.Segments(directory=tmp_path)
    link = tmp_path / f"{shm.PREFIX}1-symlink"
    link.symlink_to(secret)
    hard = tmp_path / f"{shm.PREFIX}1-hardlink"
    hard.hardlink_to(secret)
    loose = tmp_path / f"{shm.PREFIX}1-loose"
    loose.write_bytes(b"x" * 64)
    loose.chmod(0o644)
    fifo = tmp_path / f"{shm.PREFIX}1-fifo"
    os.mkfifo(fifo, 0o600)
    for f, why in ((link, "cannot open"), (hard, "links"), (loose, "mode 644"),
                   (fifo, "not a regular file")):
        with pytest.raises(shm.ShmUnavailable, match=why):
            r.region(f"{f.name}:0:4")
    r.close()


def test_a_truncated_segment_is_a_refused_write_not_a_sigbus(tmp_path):
    """Truncating a segment decode had mapped killed decode with SIGBUS. Regions are read
    with pread: the write is refused, the reader lives, the next segment reads fine."""
    a = shm.Arena(64 << 10, directory=tmp_path)
    off = a.alloc(32 << 10)
    r = shm.Segments(directory=tmp_path)
    assert len(r.region(f"{a.name}:{off}:{32 << 10}")) == 32 << 10     # opened and checked
    os.truncate(a.path, 4096)
    with pytest.raises(shm.ShmUnavailable, match="shorter"):
        r.region(f"{a.name}:{off + 8192}:{16 << 10}")
    b = shm.Arena(8192, directory=tmp_path)
    b.view[0:3] = b"abc"
    assert bytes(r.region(f"{b.name}:0:3")) == b"abc"
    r.close()
    a.close()
    b.close()


def test_sweep_removes_segments_of_dead_writers(tmp_path):
    (tmp_path / f"{shm.PREFIX}999999999-abc").write_bytes(b"x")
    live = shm.Arena(4096, directory=tmp_path)
    assert shm.sweep_dead(tmp_path) == 1 and live.path.exists()
    live.close()


class _Spy:
    """Records whether each KV write on the wire carried a handle or a payload."""

    def __init__(self):
        self.seen: list[tuple[bool, int]] = []

    async def cb(self, msg):
        self.seen.append((SHM_HEADER in (msg.headers or {}), len(msg.data)))


async def _pair(nats_url, **kw):  # noqa: F811
    rt_dec, rt_pre = ServiceRuntime("decode", "d0", nats_url), ServiceRuntime("prefill", "p0",
                                                                               nats_url)
    await rt_dec.start()
    await rt_pre.start()
    rx = NatsKvTransport(rt_dec)
    # generous: a busy CI machine once took over 2 s to answer (the unanswered write below
    # is refused at once by the server: no responders)
    tx = await ShmKvTransport.create(NatsKvTransport(rt_pre, timeout_s=30.0), **kw)
    tx.hosts["d0"] = tx.host                          # as d0's heartbeat would say
    rx.announce("p0", tx.segment)                     # as p0's heartbeat would say
    dec = Decode()
    await rx.listen("d0", dec.on_write)
    spy = _Spy()
    await rt_pre.nc.subscribe("pdmesh.decode.kv.d0", cb=spy.cb)
    # one round trip prefill -> decode first: three fresh-clone full runs had the first
    # write reach the spy but not decode (decode's connection received nothing in 30 s)
    await rt_pre.nc.request(subjects.health("decode", "d0"), b"", timeout=10)
    return rt_dec, rt_pre, rx, tx, dec, spy


def _shm_write(tx, src, blocks, dest_blocks, corrupt=False):
    buf = tx.alloc("d0", wire.piece_bytes(src, len(blocks), 0, L))
    assert buf is not None
    meta, payload = write(src, blocks, dest_blocks, corrupt=corrupt)
    wire.pack(src, blocks, 0, L, out=buf)
    assert bytes(buf) == bytes(payload)
    return meta, buf


async def test_same_host_write_carries_a_handle_and_lands(nats_url):  # noqa: F811
    rt_dec, rt_pre, rx, tx, dec, spy = await _pair(nats_url, size_bytes=1 << 20)
    try:
        src = pool()
        try:
            ack = await tx.send("d0", *_shm_write(tx, src, [3, 7], [0, 5]))
        except TimeoutError as e:       # twice in a fresh-clone full run, never alone: say more
            raise AssertionError(
                f"unanswered: on the wire {spy.seen}, decode applied {len(dec.writes)}, "
                f"in flight {dec.active}, connected {rt_pre.nc.is_connected}/"
                f"{rt_dec.nc.is_connected}, stats {rt_pre.nc.stats} / {rt_dec.nc.stats}") from e
        assert ack.applied and torch.equal(dec.kv[:, :, [0, 5]], src[:, :, [3, 7]])
        await rt_pre.nc.flush()
        assert spy.seen == [(True, 0)]                # only the handle crossed NATS
        assert tx.counters["kv_shm_writes"] == 1 and tx.arena.bytes_used == 0
        with pytest.raises(ServiceError) as e:        # the checksum still guards the bytes
            await tx.send("d0", *_shm_write(tx, src, [1], [1], corrupt=True))
        assert e.value.reply.code is ErrorCode.BAD_MESSAGE and tx.arena.bytes_used == 0
        # KvSender over it, end to end: every write through the segment
        snd, led = sender(tx, window=2)
        issued, _ = await snd.send(job([1, 2, 3]), Engine([4, 5, 6]), "local", "a1")
        assert issued == led.get("a1").completed and tx.counters["kv_shm_writes"] == 1 + issued
        # an unanswered write: its region stays out of use
        tx.hosts["nobody"] = tx.host
        buf = tx.alloc("nobody", 4096)
        meta, _ = write(src, [1], [1])
        with pytest.raises(Exception):
            await tx.send("nobody", meta, buf)
        assert tx.counters["kv_shm_retired"] == 1 and tx.arena.bytes_used == 4096
    finally:
        await tx.close()
        await rt_pre.close()
        await rt_dec.close()


async def test_decode_that_cannot_read_the_segment_gets_nats(nats_url, tmp_path):  # noqa: F811
    rt_dec, rt_pre, rx, tx, dec, spy = await _pair(nats_url, size_bytes=1 << 20)
    rx.segments = shm.Segments(directory=tmp_path)     # decode sees another /dev/shm
    try:
        src = pool()
        assert (await tx.send("d0", *_shm_write(tx, src, [2], [4]))).applied
        assert torch.equal(dec.kv[:, :, [4]], src[:, :, [2]])
        assert "d0" in tx.refused and tx.alloc("d0", 10) is None
        await rt_pre.nc.flush()
        assert spy.seen == [(True, 0), (False, wire.piece_bytes(src, 1, 0, L))]
    finally:
        await tx.close()
        await rt_pre.close()
        await rt_dec.close()


async def test_off_switch_other_hosts_and_a_full_segment_use_nats(nats_url):  # noqa: F811
    rt_dec, rt_pre, rx, tx, dec, spy = await _pair(nats_url, size_bytes=8192)
    try:
        assert tx.alloc("d0", 16384) is None and tx.counters["kv_shm_fallbacks"] == 1
        tx.hosts["d0"] = "elsewhere"
        assert tx.alloc("d0", 10) is None
        off = await ShmKvTransport.create(NatsKvTransport(rt_pre), enabled=False)
        off.hosts["d0"] = off.host
        assert off.alloc("d0", 10) is None
    finally:
        await tx.close()
        await rt_pre.close()
        await rt_dec.close()


async def test_a_segment_its_writer_did_not_announce_is_not_read(nats_url):  # noqa: F811
    """A write whose handle names any segment but the one its sender announced (in its
    heartbeat) is refused before decode opens anything: a real, well-formed segment of
    this user made by someone else is refused as surely as a symlink."""
    rt_dec, rt_pre, rx, tx, dec, spy = await _pair(nats_url, size_bytes=1 << 20)
    other = shm.Arena(1 << 16)
    try:
        src = pool()
        meta, payload = write(src, [1], [2])
        other.view[0:len(payload)] = bytes(payload)
        msg = await tx.inner.request("d0", meta, b"",
                                     {SHM_HEADER: f"{other.name}:0:{len(payload)}"})
        with pytest.raises(ServiceError) as e:
            tx.inner.answer(msg)
        assert e.value.reply.code is ErrorCode.BAD_MESSAGE and "announced" in str(e.value)
        assert dec.writes == [] and rx.segments is None      # nothing was opened
        assert (await tx.send("d0", *_shm_write(tx, src, [1], [2]))).applied   # its own
    finally:
        other.close()
        await tx.close()
        await rt_pre.close()
        await rt_dec.close()
