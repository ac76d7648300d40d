"""The NATS permission table is one source of truth (shared/subjects.py GRANTS): every
subject the code builds is in it, each service's code uses only subjects granted to that
service, and the nats-server config generated from it (pdmesh/deploy/creds.py) is valid and
least-privilege. The server enforcing it: tests/e2e/test_nats_auth.py."""
from __future__ import annotations

import ast
import stat
import subprocess
from pathlib import Path

import pytest

from pdmesh.deploy.creds import USERS, Secrets, auth_conf
from pdmesh.local.cluster import nats_server_binary
from shared import subjects as S
from tests.authserver import AuthServer

ROOT = Path(__file__).resolve().parents[1]
# functions of shared/subjects.py that build no subject of their own (request_event builds
# request_anomaly & co., each granted by name)
HELPERS = {"instance_token", "pattern", "permissions", "control", "request_event"}
SUBJECT_FNS = {n for n, v in vars(S).items() if callable(v) and getattr(v, "__module__", "")
               == S.__name__ and not n.startswith("_") and n not in HELPERS
               and not isinstance(v, type)}
GRANTED = {g.fn for g in S.GRANTS}


def _calls(path: Path) -> set[str]:
    """Names f of every `subjects.f(...)` call in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subjects"):
            out.add(node.func.attr)
    return out


def _code() -> list[Path]:
    return [p for d in ("services", "shared", "pdmesh") for p in (ROOT / d).rglob("*.py")
            if p.name != "subjects.py"]


def test_every_subject_function_is_granted_or_a_tool():
    assert SUBJECT_FNS - GRANTED <= set(S.TOOLS), sorted(SUBJECT_FNS - GRANTED - set(S.TOOLS))
    assert GRANTED <= SUBJECT_FNS                # no grant names a function that is gone


def test_every_subject_the_code_builds_is_in_the_table():
    used = {(p.relative_to(ROOT).as_posix(), f) for p in _code() for f in _calls(p)}
    assert used, "found no subjects.* calls: the scan is broken"
    missing = sorted((p, f) for p, f in used if f not in GRANTED | set(S.TOOLS) | HELPERS)
    assert not missing, f"subjects used but not in subjects.GRANTS: {missing}"


def test_each_service_uses_only_subjects_granted_to_it():
    """services/<name>/ builds only subjects granted to <name> (shared/ modules run in
    several services: the e2e test with auth on covers them)."""
    for p in (ROOT / "services").rglob("*.py"):
        user = p.relative_to(ROOT / "services").parts[0]
        for f in _calls(p) - HELPERS:
            assert any(user in g.pub + g.sub for g in S.GRANTS if g.fn == f), (p, f, user)


def test_grants_are_least_privilege():
    for user in S.IDENTITIES:
        perms = S.permissions(user)
        everything = {">", "pdmesh.>", "_INBOX.>", "$JS.API.>", "$JS.>"}
        assert not everything & set(perms["publish"] + perms["subscribe"]), user
        assert f"_INBOX.{user}.>" in perms["subscribe"]        # its own replies only
        assert S.heartbeat(user) in perms["publish"]
        others = [S.heartbeat(o) for o in S.IDENTITIES if o != user]
        assert not set(others) & set(perms["publish"]), user    # no forged heartbeats
        assert not any("DELETE" in s or "PURGE" in s for s in perms["publish"]), user
        stream_writes = ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE", "STREAM.PURGE")
        assert not any(w in s for s in perms["publish"] for w in stream_writes), user
    admin = S.permissions(S.ADMIN)        # the job stream's keeper: that stream, nothing else
    assert all(s == "$JS.API.INFO" or s.endswith(f".{S.PREFILL_STREAM}")
               for s in admin["publish"]), admin
    assert admin["subscribe"] == [f"_INBOX.{S.ADMIN}.>"]
    debug = S.permissions(S.DEBUG)
    assert debug["subscribe"] == [">"]
    bench = {S.pattern("bench_raw", S.ANY), f"_INBOX.{S.DEBUG}.>"}    # pdmesh bench's floor
    assert all(s.startswith(("$SRV.", "$JS.API.")) or "health" in s.split(".") or s in bench
               for s in debug["publish"]), debug["publish"]          # read-only
    assert not any(S.pattern("bench_raw", S.ANY) in S.permissions(u)["subscribe"]
                   for u in S.IDENTITIES)                             # no service reads it
    assert not any(v in s for s in debug["publish"] for v in ("CREATE", "UPDATE", "DELETE"))
    assert S.pattern("decode_kv", S.ANY) in S.permissions("prefill")["publish"]
    for user in ("gateway", "decode", "kvstore", S.DEBUG):
        assert S.pattern("decode_kv", S.ANY) not in S.permissions(user)["publish"]
    writers = [u for u in USERS if S.kvstore_put() in S.permissions(u)["publish"]]
    assert writers == ["decode", "prefill"]      # who computes KV (decode: colocated prompts)


def test_generated_server_config_is_valid(tmp_path):
    s = Secrets.create(tmp_path / "creds")
    conf = tmp_path / "n.conf"
    conf.write_text("listen: 127.0.0.1:4222\ninclude \"creds/auth.conf\"\n")
    r = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr + r.stdout
    text = (tmp_path / "creds" / "auth.conf").read_text()
    assert text == auth_conf(s.passwords)
    for user in USERS:
        f = s.password_file(user)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert f.read_text().strip() == s.passwords[user] and len(s.passwords[user]) >= 24
        for subject in S.permissions(user)["publish"]:
            assert f'"{subject}"' in text          # quoted: "$SRV..." is not a variable
    again = Secrets.create(tmp_path / "creds", keep=True)
    assert again.passwords == s.passwords         # compose: re-running keeps them
    assert Secrets.create(tmp_path / "creds").passwords != s.passwords


@pytest.mark.parametrize("user", USERS)
def test_a_user_connects_with_its_env(user, tmp_path):
    s = Secrets.create(tmp_path)
    env = s.env(user)
    assert env["PDMESH_NATS_USER"] == user and Path(env["PDMESH_NATS_PASSWORD_FILE"]).is_file()
    opts = s.auth(user).options()
    assert opts["password"] == s.passwords[user] and opts["inbox_prefix"] == f"_INBOX.{user}"


# ---- $SRV requests: each one a service makes is granted (a denied one is a silent gap) ----
MICRO_VERBS = {"stats": "STATS", "service_stats": "STATS", "total_stats": "STATS",
               "ping": "PING", "survey": "PING"}


def _micro_calls(path: Path) -> set[tuple[str, str]]:
    """(VERB, service) of every `micro.<fn>(nc, "<service>", ...)` call in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "micro"
                and node.func.attr in MICRO_VERBS):
            svc = node.args[1] if len(node.args) > 1 else None
            name = svc.value if isinstance(svc, ast.Constant) else None
            out.add((MICRO_VERBS[node.func.attr], name))
    return out


def test_every_srv_request_a_service_makes_is_granted_to_it():
    seen = 0
    for p in (ROOT / "services").rglob("*.py"):
        user = p.relative_to(ROOT / "services").parts[0]
        for verb, service in _micro_calls(p):
            seen += 1
            assert service is not None, f"{p}: micro.{verb} of every service is not grantable"
            assert f"$SRV.{verb}.{service}" in S.permissions(user)["publish"], (p, verb, user)
    assert seen >= 2, "found no micro calls in services/: the scan is broken"


def test_the_job_queue_s_jetstream_requests_are_granted(tmp_path):
    """Every $JS.API request the job queue makes, as the service that makes it, against a
    real server with the generated permissions: the admin makes the stream, decode queues a job,
    prefill makes its durable consumer, pulls the job, marks it in progress and acks it."""
    import asyncio

    from shared import jobqueue, jobstream

    srv = AuthServer(tmp_path)

    async def go() -> bytes:
        dec, pre = await srv.connect("decode"), await srv.connect("prefill")
        admin = await srv.connect(S.ADMIN)
        await jobstream.ensure_stream(admin.jetstream())          # pdmesh up's keeper
        await jobqueue.publish_job(dec.jetstream(), b"job-1", msg_id="job-1")
        puller = await jobqueue.pull_subscription(pre.jetstream(), 10.0, 5, 4)
        (msg,) = await puller.fetch(1, timeout=5)
        await msg.in_progress()
        await msg.ack()
        assert await puller.repair(check=True) is False       # consumer_info: found
        await dec.flush()
        await pre.flush()
        await asyncio.sleep(0.2)      # a violation comes back as an async -ERR
        for nc in (dec, pre, admin):
            await nc.close()
        return msg.data
    try:
        assert asyncio.run(go()) == b"job-1"
    finally:
        srv.close()
    assert srv.violations == []


def test_the_gateway_reads_its_metrics_sources_under_auth(tmp_path):
    """Every $SRV request /metrics makes, as the gateway's NATS user against a real
    nats-server with the generated permissions: none is refused (it used to log
    'permissions violation for publish to "$srv.stats.prefill"' on every scrape)."""
    import asyncio

    from services.gateway.scrape import MeshStats

    srv = AuthServer(tmp_path)

    async def scrape() -> None:
        nc = await srv.connect("gateway")
        await MeshStats(lambda: nc, 1.0).refresh()    # decode's, prefill's, kvstore's STATS
        await nc.flush()
        await asyncio.sleep(0.2)      # a violation comes back as an async -ERR
        await nc.close()
    try:
        asyncio.run(scrape())
    finally:
        srv.close()
    assert srv.violations == []
