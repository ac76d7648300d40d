"""NATS identities and TLS on a local mesh (issue 12), without a model: a three-node
cluster with users and TLS (routes verify each other with the run's CA) comes up and
kvstore registers over it; clients without the CA, without TLS, without a password or
with a wrong one are turned away; the read-only debug user can look but not write.
Real nats-servers (the mesh with every service under auth: tests/e2e/test_nats_auth.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nats
import pytest

from pdmesh.local.cluster import Cluster
from shared import jobstream, micro, subjects

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


async def _refused(**opts) -> str:
    try:
        nc = await nats.connect(**opts, connect_timeout=2, allow_reconnect=False,
                                max_reconnect_attempts=0)
    except Exception as e:  # noqa: BLE001 - what we want
        return repr(e)
    await nc.close()
    return ""


async def test_tls_cluster_with_users_serves_and_turns_strangers_away():
    async with Cluster(model="unused", prefill=0, decode=0, gateway=False, echo=False,
                       nats_cluster=3, nats_auth=True, nats_tls=True) as c:
        creds = c.secrets.dir
        assert creds.parent == c.tmp                  # in the run directory, gone with it
        assert {"ca.pem", "server.pem", "auth.conf", "kvstore.password"} <= {
            p.name for p in creds.iterdir()}
        conf = (c.tmp / "nats-0.conf").read_text()
        assert "tls {" in conf and "verify: true" in conf
        assert f'include "{creds.name}/auth.conf"' in conf
        assert c.nats_url.startswith("tls://debug:")
        assert "PDMESH_NATS_PASSWORD" not in c.procs["kvstore-0"].env           # a file
        assert c.procs["kvstore-0"].env["PDMESH_NATS_USER"] == "kvstore"
        assert "password" not in " ".join(c.procs["kvstore-0"].argv)

        nc = await nats.connect(**c.client_options())          # debug, verifying the CA
        assert [i.instance_id for i in await micro.ping(nc, "kvstore")] == ["kvstore_0"]
        servers = c.client_options()["servers"]
        plain = [u.replace("tls://", "nats://") for u in servers]
        assert "CERTIFICATE_VERIFY_FAILED" in await _refused(servers=servers)   # no CA
        assert await _refused(servers=plain, user="debug",                       # no TLS
                              password=c.secrets.passwords["debug"])
        opts = c.client_options("kvstore")
        assert await _refused(**(opts | {"password": "wrong"}))
        assert await _refused(**{k: v for k, v in opts.items()
                                 if k not in ("user", "password")})            # no user

        prefill = await nats.connect(**c.client_options("prefill"))
        admin = await nats.connect(**c.client_options(subjects.ADMIN))  # the keeper's user
        assert await jobstream.ensure_stream(admin.jetstream()) == 3    # routes are up
        errors: list[str] = []

        async def on_error(e) -> None:
            errors.append(str(e))
        debug = await nats.connect(**c.client_options(), error_cb=on_error)
        info = await debug.jetstream().stream_info(subjects.PREFILL_STREAM)   # may look
        assert info.config.num_replicas == 3
        await debug.publish(subjects.prefill_jobs(), b"x")                  # may not write
        await debug.flush()
        await micro.ping(debug)
        assert any("permissions violation for publish" in e.lower() for e in errors), errors
        assert (await prefill.jetstream().stream_info(subjects.PREFILL_STREAM)).state.messages == 0
        for n in (nc, prefill, debug, admin):
            await n.close()

        # the container health check connects as the service's own user (compose)
        hc = [sys.executable, "-m", "pdmesh.deploy.healthcheck", "kvstore", "--nats-url",
              c.nats.url, "--instance-id", "kvstore_0"]
        env = c.procs["kvstore-0"].env
        assert subprocess.run(hc, env=env, timeout=60).returncode == 0
        stranger = {k: v for k, v in env.items() if k != "PDMESH_NATS_PASSWORD_FILE"}
        assert subprocess.run(hc, env=stranger, timeout=60,
                              capture_output=True).returncode == 1


def test_up_has_the_nats_flags():
    out = subprocess.run([sys.executable, "-m", "pdmesh", "up", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    for flag in ("--nats-cluster", "--nats-auth", "--no-nats-auth", "--tls"):
        assert flag in out, flag
    from pdmesh.cli import build_parser
    args = build_parser().parse_args(["up", "--model", "m"])
    assert args.nats_auth is True and args.tls is False and args.host == "127.0.0.1"
