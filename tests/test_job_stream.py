"""The job stream belongs to the admin identity (issue 29): no service may create, update,
seal, delete or purge it, and the keeper puts back any change to its configuration.

Attacked as a compromised service would: with prefill's credentials, a `republish` rule
made the server re-publish prefill's messages onto subjects prefill may not publish to
(attacker text in another tenant's response, forged decode heartbeats); with decode's,
renaming the stream's subject stalled every PD request, and `sealed: true` turned PD off
for good. Real nats-server, the generated users and permissions (pdmesh/deploy/creds.py)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from nats.js.api import RePublish

from pdmesh.deploy.streamkeeper import StreamKeeper
from shared import jobqueue, jobstream, subjects as S
from tests.authserver import AuthServer

pytestmark = pytest.mark.timeout(60)

# a change to the stream's config -> what it does to the mesh
CHANGES = {
    "republish": lambda c: replace(c, republish=RePublish(
        src=S.prefill_jobs(), dest=S.heartbeat("decode"))),   # forged decode heartbeats
    "seal": lambda c: replace(c, sealed=True),                # PD off for good
    "rename": lambda c: replace(c, subjects=["pdmesh.elsewhere"]),   # jobs go nowhere
    "limits": lambda c: replace(c, max_msgs=1, max_age=300.0),  # jobs dropped
}


async def _attempts(js) -> dict[str, str]:
    """Every way to change the stream, at once; name -> "refused" or "done"."""
    async def attempt(coro) -> str:
        try:
            await coro
        except Exception:  # noqa: BLE001 - refused (no reply to a forbidden request)
            return "refused"
        return "done"
    cfg = jobstream.stream_config(1)
    tries = {name: js.update_stream(change(cfg)) for name, change in CHANGES.items()}
    tries |= {"delete": js.delete_stream(S.PREFILL_STREAM),
              "purge": js.purge_stream(S.PREFILL_STREAM),
              "shadow": js.add_stream(replace(cfg, name="SHADOW"))}
    names = list(tries)
    return dict(zip(names, await asyncio.gather(*(attempt(tries[n]) for n in names))))


@pytest.mark.parametrize("user", [*S.IDENTITIES, S.DEBUG])
def test_no_service_may_change_the_job_stream(tmp_path, user):
    srv = AuthServer(tmp_path)

    async def go():
        admin, dec = await srv.connect(S.ADMIN), await srv.connect("decode")
        await jobstream.ensure_stream(admin.jetstream())
        await jobqueue.publish_job(dec.jetstream(), b"queued")
        attacker = await srv.connect(user)
        outcome = await _attempts(attacker.jetstream(timeout=1.0))
        await attacker.flush()
        await asyncio.sleep(0.2)          # violations come back as async -ERRs
        info = await admin.jetstream().stream_info(S.PREFILL_STREAM)
        debug = await srv.connect(S.DEBUG)
        names = await debug.jetstream().streams_info()
        for nc in (admin, dec, attacker, debug):
            await nc.close()
        return outcome, info, [s.config.name for s in names]
    try:
        outcome, info, streams = asyncio.run(go())
    finally:
        srv.close()
    assert outcome == {n: "refused" for n in outcome}, outcome
    assert jobstream.drift(info.config, jobstream.stream_config(1)) == []
    assert info.state.messages == 1 and streams == [S.PREFILL_STREAM]
    assert any("$js.api.stream.update" in v.lower() for v in srv.violations), srv.violations


def test_the_keeper_puts_back_every_change(tmp_path):
    """Whatever the admin's own stream went through (a change made by hand, a store lost),
    one check of the keeper restores the whole configuration; a sealed stream, which no
    update can unseal, is made anew; the job queue works afterwards."""
    srv = AuthServer(tmp_path)

    async def go():
        admin, dec = await srv.connect(S.ADMIN), await srv.connect("decode")
        pre = await srv.connect("prefill")
        keeper = StreamKeeper({"servers": [f"nats://127.0.0.1:{srv.port}"],
                               **srv.secrets.auth(S.ADMIN).options()})
        await keeper.start()
        js = admin.jetstream()
        seen = {}
        for name, change in CHANGES.items():
            await js.update_stream(change(jobstream.stream_config(1)))
            before = jobstream.drift((await js.stream_info(S.PREFILL_STREAM)).config,
                                     jobstream.stream_config(1))
            await keeper.check()
            after = (await js.stream_info(S.PREFILL_STREAM)).config
            seen[name] = (before, jobstream.drift(after, jobstream.stream_config(1)))
        await js.delete_stream(S.PREFILL_STREAM)
        await keeper.check()
        seen["deleted"] = ([], jobstream.drift(
            (await js.stream_info(S.PREFILL_STREAM)).config, jobstream.stream_config(1)))
        await jobqueue.publish_job(dec.jetstream(), b"job")
        puller = await jobqueue.pull_subscription(pre.jetstream(), 10.0, 5, 4)
        (msg,) = await puller.fetch(1, timeout=5)
        await msg.ack()
        repairs = keeper.repairs
        await keeper.close()
        for nc in (admin, dec, pre):
            await nc.close()
        return seen, msg.data, repairs
    try:
        seen, job, repairs = asyncio.run(go())
    finally:
        srv.close()
    assert seen["republish"][0] == ["republish"] and "sealed" in seen["seal"][0]
    assert all(before for name, (before, _) in seen.items() if name != "deleted"), seen
    assert all(after == [] for _, after in seen.values()), seen
    assert job == b"job" and repairs == len(seen)
    assert srv.violations == []


def test_the_health_check_says_when_the_stream_is_wrong(tmp_path, monkeypatch):
    """compose's `jobstream` container is healthy only while the stream is there with
    exactly its configuration (prefill and decode wait for that)."""
    from pdmesh.deploy.healthcheck import check_stream

    srv = AuthServer(tmp_path)
    for k, v in srv.secrets.env(S.ADMIN).items():
        monkeypatch.setenv(k, v)
    url = f"nats://127.0.0.1:{srv.port}"

    async def go():
        admin = await srv.connect(S.ADMIN)
        js = admin.jetstream()
        missing = await check_stream(url, 2.0)
        await jobstream.ensure_stream(js)
        good = await check_stream(url, 2.0)
        await js.update_stream(CHANGES["limits"](jobstream.stream_config(1)))
        changed = await check_stream(url, 2.0)
        await admin.close()
        return missing, good, changed
    try:
        missing, good, changed = asyncio.run(go())
    finally:
        srv.close()
    assert "NotFoundError" in missing and good is None
    assert changed == "job stream differs in max_age, max_msgs", changed
