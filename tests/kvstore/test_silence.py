"""A kvstore that stops answering costs one lookup timeout, not one per request: after a
timeout, asks are skipped but for one probe every probe_s, and the first answer ends it."""
from __future__ import annotations

import asyncio

import nats

from shared import subjects
from shared.contracts.common import encode
from shared.contracts.kvcache import KvLookupReply
from shared.contracts.messages import Heartbeat
from shared.kv.silence import Silence
from shared.kvstore_client import KvstoreClient
from tests import natsserver


def test_answering_peer_is_always_asked():
    s = Silence(probe_s=1.0)
    assert all(s.may_ask(t / 10) for t in range(30)) and not s.silent


def test_after_a_timeout_one_probe_per_interval_until_an_answer():
    s = Silence(probe_s=1.0)
    s.timed_out(10.0)
    assert s.silent and s.since == 10.0
    asked = [t / 10 for t in range(100, 135) if s.may_ask(t / 10)]
    assert asked == [11.0, 12.0, 13.0]               # the rest: a miss at once
    s.timed_out(13.0)                                # a probe that timed out again
    assert s.since == 10.0 and not s.may_ask(13.5) and s.may_ask(14.0)
    s.answered()                                     # back: every ask goes out
    assert not s.silent and all(s.may_ask(14.0 + t / 100) for t in range(10))


async def test_a_silent_kvstore_is_asked_again_as_soon_as_it_heartbeats(tmp_path):
    """A real nats-server; kvstore frozen (its lookup subscription never answers): the
    first lookup times out, the next is skipped at once. Its heartbeat, as a restarted or
    thawed kvstore sends it, ends the silence well before the next probe (5 s): lookups
    and write-backs go to it again. Before, a restarted kvstore got no write-back until a
    probe got through, and the next requests missed the cache (test_hicache's restart)."""
    proc, port = natsserver.start()
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    try:
        frozen = await nc.subscribe(subjects.kvstore_lookup(), cb=_never_answer)
        kvc = KvstoreClient(nc, timeout_s=0.3)
        await kvc.follow_heartbeats()
        assert await kvc.lookup([b"k" * 16]) == 0 and kvc.silence.silent
        assert await kvc.lookup([b"k" * 16]) == 0
        assert kvc.counters["kv_lookups_skipped"] == 1
        await frozen.unsubscribe()
        await nc.subscribe(subjects.kvstore_lookup(), cb=_hits(nc, 1))     # thawed
        await nc.publish(subjects.heartbeat("kvstore"),
                         encode(Heartbeat(service="kvstore", instance_id="kvstore-0")))
        for _ in range(40):
            if not kvc.silence.silent:
                break
            await asyncio.sleep(0.05)
        assert not kvc.silence.silent, "a heartbeat did not end the silence"
        assert await kvc.lookup([b"k" * 16]) == 1
        assert kvc.counters["kv_lookups_skipped"] == 1
    finally:
        await nc.close()
        proc.terminate()
        proc.wait(10)


async def _never_answer(_msg) -> None:
    pass


def _hits(nc, n: int):
    async def answer(msg) -> None:
        await msg.respond(encode(KvLookupReply(hits=n)))
    return answer
