"""The bus is not trusted (issue 12): every service connects as its own NATS user, and the
server refuses what that user was not granted (shared/subjects.py GRANTS). Attacked as an
attacker would: with each service's own credentials (a compromised process), publish a
KV write, an abort, a token chunk, a kvstore put, a forged heartbeat, a job, a JetStream
stream deletion; subscribe to another service's traffic or another user's replies. Each
is refused by the server (a permissions violation), a spy that sees every subject
receives 0 of them, and the mesh answers correctly throughout. Real nats-server, real
services, real HTTP."""
from __future__ import annotations

import asyncio

import aiohttp
import nats
import pytest

from pdmesh.local.cluster import Cluster
from shared import subjects as S
from shared.contracts.sampling import SamplingParams

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete

pytestmark = pytest.mark.timeout(300)
MARK = b"ATTACK"
JS_DELETE = f"$JS.API.STREAM.DELETE.{S.PREFILL_STREAM}"
JS_UPDATE = f"$JS.API.STREAM.UPDATE.{S.PREFILL_STREAM}"     # republish rules, a seal
JS_CREATE = f"$JS.API.STREAM.CREATE.{S.PREFILL_STREAM}"
JS_PULL = f"$JS.API.CONSUMER.MSG.NEXT.{S.PREFILL_STREAM}.{S.PREFILL_CONSUMER}"
# what is attacked -> the only users allowed to publish it
ATTACKS = {
    S.decode_kv("decode_0"): {"prefill"},              # KV writes into reserved blocks
    S.decode_claim("decode_0"): {"prefill"},
    S.decode_prefill_done("decode_0"): {"prefill"},
    S.decode_abort("decode_0"): {"gateway"},           # aborting anyone's request
    S.decode_submit("decode_0"): {"gateway"},
    S.gateway_tokens("gateway_0"): {"decode"},         # injecting tokens into a stream
    S.kvstore_put(): {"prefill", "decode"},            # poisoning the cache tiers
    S.prefill_jobs(): {"decode"},
    S.prefill_reclaim("prefill_0"): {"decode"},
    **{S.heartbeat(s): {s} for s in S.IDENTITIES},     # forged load reports
    JS_DELETE: set(), JS_UPDATE: set(), JS_CREATE: set(),   # the admin's alone
    JS_PULL: {"prefill"},
}
# reading what is not yours: the other services' traffic, their replies, everything
SNOOPS = {
    "gateway": [S.pattern("decode_kv", S.ANY), S.kvstore_put(), "_INBOX.decode.>", "pdmesh.>"],
    "decode": [S.kvstore_put(), S.pattern("gateway_tokens", S.ANY), "_INBOX.prefill.>", ">"],
    "prefill": [S.pattern("decode_submit", S.ANY), S.pattern("gateway_tokens", S.ANY),
                "_INBOX.gateway.>"],
    "kvstore": [S.pattern("gateway_tokens", S.ANY), S.pattern("decode_kv", S.ANY),
                S.pattern("decode_abort", S.ANY), "_INBOX.>"],
    S.DEBUG: [],            # reads everything by design; it publishes nothing of the mesh
}


class Attacker:
    """A connection as `user` that records the server's permission violations."""

    def __init__(self, user: str):
        self.user, self.errors, self.got = user, [], []

    async def connect(self, c: Cluster) -> "Attacker":
        async def on_error(e) -> None:
            self.errors.append(str(e).lower())

        self.nc = await nats.connect(**c.client_options(self.user), error_cb=on_error,
                                     max_reconnect_attempts=0)
        return self

    def refused(self, kind: str, subject: str) -> bool:
        return any(f"permissions violation for {kind} to \"{subject.lower()}\"" in e
                   for e in self.errors)


async def _spy(c: Cluster, seen: list) -> nats.NATS:
    nc = await nats.connect(**c.client_options(S.DEBUG))

    async def on_msg(msg) -> None:
        if msg.data.startswith(MARK):
            seen.append(msg.subject)
    await nc.subscribe(">", cb=on_msg)
    await nc.flush()
    return nc


def test_each_identity_is_refused_outside_its_grant_and_the_mesh_serves(tiny_target,
                                                                        tiny_prompts):
    prompts = [sum(tiny_prompts[i:i + 8], []) for i in range(6)]   # whole KV blocks: the
    assert all(len(p) > 32 for p in prompts)         # cache write-backs run too
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o["token_ids"] for o in reference_engine(tiny_target).generate(prompts, params)]
    logs: list[str] = []
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, nats_auth=True,
                 overrides=det_overrides(mode="pd"), echo=logs.append) as c:
        async def serve(http) -> list[list[int]]:
            return [(await complete(http, c.url, p, ("pd", "colocated")[i % 2],  # both paths
                                    temperature=0.0, max_tokens=12, ignore_eos=True))[0]
                    for i, p in enumerate(prompts)]

        async def attack(user: str, seen: list) -> Attacker:
            a = await Attacker(user).connect(c)
            for subject, allowed in ATTACKS.items():
                if user not in allowed:
                    await a.nc.publish(subject, MARK + user.encode())
            async def on_msg(msg) -> None:
                a.got.append(msg.subject)
            for pattern in SNOOPS[user]:
                await a.nc.subscribe(pattern, cb=on_msg)
            await a.nc.flush()
            return a

        async def run():
            seen: list[str] = []
            spy = await _spy(c, seen)
            async with aiohttp.ClientSession() as http:
                before = await serve(http)
                attackers = await asyncio.gather(*(attack(u, seen) for u in
                                                   (*S.IDENTITIES, S.DEBUG)))
                during = await serve(http)          # traffic the snoopers would have seen
                # positive control: a granted publish does reach the spy
                ok = await Attacker("decode").connect(c)
                await ok.nc.publish(S.request_anomaly(), MARK + b"granted")
                await ok.nc.flush()
                await asyncio.sleep(0.5)
                after = await serve(http)
            for a in (*attackers, ok):
                await a.nc.close()
            await spy.close()
            return before, during, after, attackers, ok, seen

        before, during, after, attackers, ok, seen = asyncio.run(run())
        assert before == during == after == want            # correct output throughout
        assert seen == [S.request_anomaly()], seen          # 0 deliveries of any attack
        assert not ok.errors
        for a in attackers:
            for subject, allowed in ATTACKS.items():
                if a.user not in allowed:
                    assert a.refused("publish", subject), (a.user, subject, a.errors)
            for pattern in SNOOPS[a.user]:
                assert a.refused("subscription", pattern), (a.user, pattern, a.errors)
            assert a.got == [], (a.user, a.got)
        assert c.unexpected_exits() == []
    # and no service was ever refused anything it does on its own (the grants suffice)
    refused = [line for line in logs if line.startswith("[nats]") and "Violation" in line]
    assert refused and not [line for line in refused
                            if any(f':{s}:{s}_0"' in line for s in S.IDENTITIES)], refused


def test_no_reply_can_be_aimed_at_another_subject(tiny_target, tiny_prompts):
    """Issue 29: with allow_responses a requester chose where a service published its
    reply, so the read-only debug user made services publish onto token, abort, KV and job
    subjects. Replies now go only to inboxes: asked with a reply subject that is not one,
    no service answers (shared/replies.py; the servers also allow each service only its
    callers' inboxes), a spy sees nothing there, no job is queued, and the mesh answers
    correctly."""
    prompt = sum(tiny_prompts[:2], [])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (want,) = [o["token_ids"] for o in reference_engine(tiny_target).generate([prompt],
                                                                               params)]
    targets = [S.gateway_tokens("gateway_0"), S.decode_abort("decode_0"),
               S.decode_kv("decode_0"), S.prefill_jobs(), S.heartbeat("decode")]
    asks = [S.health(s, f"{s}_0") for s in S.IDENTITIES] + ["$SRV.PING", "$SRV.INFO"]
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET,
                 overrides=det_overrides(mode="pd"), echo=False) as c:
        async def run():
            seen: list[str] = []
            spy = await nats.connect(**c.client_options(S.DEBUG))

            async def on_msg(msg) -> None:
                if msg.subject in targets and not msg.subject.startswith("pdmesh.evt"):
                    seen.append(msg.subject + " " + msg.data[:80].decode(errors="replace"))
                elif msg.subject == S.heartbeat("decode") and b"instance_id" not in msg.data:
                    seen.append(msg.subject)           # a reply, not a heartbeat
            await spy.subscribe(">", cb=on_msg)
            await spy.flush()
            debug = await nats.connect(**c.client_options(S.DEBUG))
            for ask in asks:
                for target in targets:
                    await debug.publish(ask, b"", reply=target)
            await debug.flush()
            await asyncio.sleep(1.0)
            for nc in (spy, debug):        # what follows is the mesh's own traffic
                await nc.close()
            async with aiohttp.ClientSession() as http:
                got = (await complete(http, c.url, prompt, "pd", temperature=0.0,
                                      max_tokens=8, ignore_eos=True))[0]
            return seen, got
        seen, got = asyncio.run(run())
        assert seen == [], seen
        assert got == want
        assert c.unexpected_exits() == []
