"""The local mesh's fork server (pdmesh.local.zygote, pdmesh.local.forks): a forked child is
the process `python -m MODULE FLAGS` would be, as its supervisor, ps and the tools see it;
what cannot be forked faithfully is not; a dead zygote takes its children with it and is
started again."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import pytest

from pdmesh.local.forks import ForkServer
from pdmesh.local.launch import child_env

pytestmark = pytest.mark.timeout(120)

PROBE = '''
import json, os, sys, time
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(json.dumps({"argv": sys.argv[1:], "user": os.environ.get("PDMESH_NATS_USER"),
                  "cwd": os.getcwd(), "sid": os.getsid(0), "fds": fds,
                  "name": __name__, "stdin": os.read(0, 10).decode()}), flush=True)
if "--wait" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
'''


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    mod = tmp_path_factory.mktemp("mods")
    (mod / "probe.py").write_text(PROBE)
    env = child_env({"PYTHONPATH": f"{mod}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    forks = ForkServer(env)
    forks.start()
    assert forks.wait_ready(90), "\n".join(forks.lines)
    yield forks, env
    forks.close()


def run(forks, env, *flags, fds=()):
    child = forks.spawn([sys.executable, "-m", "probe", *flags], env, fds)
    assert child is not None
    return child


def test_a_forked_child_is_what_python_m_would_be(zygote, tmp_path):
    forks, env = zygote
    child = run(forks, env | {"PDMESH_NATS_USER": "decode"}, "--flag", "x y", "3")
    out = json.loads(child.stdout.readline())
    assert child.wait(30) == 3                               # its exit code, reported
    assert out["argv"] == ["--flag", "x y", "3"] and out["name"] == "__main__"
    assert out["user"] == "decode"                           # its own environment
    assert out["sid"] == child.pid                           # its own session
    assert out["stdin"] == "" and out["cwd"] == os.getcwd()
    assert out["fds"] == [0, 1, 2, 3]                        # 3: listdir's own; none leaked


def test_ps_and_tools_see_its_command_line_and_environment(zygote):
    forks, env = zygote
    child = run(forks, env | {"PDMESH_NATS_USER": "prefill"}, "--wait")
    json.loads(child.stdout.readline())
    cmdline = open(f"/proc/{child.pid}/cmdline", "rb").read().split(b"\0")
    assert [a.decode() for a in cmdline if a] == [sys.executable, "-m", "probe", "--wait"]
    environ = open(f"/proc/{child.pid}/environ", "rb").read().split(b"\0")
    assert b"PDMESH_NATS_USER=prefill" in environ
    assert not any(e.startswith(b"PDMESH_ZYGOTE_ROOM") for e in environ)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def test_a_passed_socket_keeps_its_number(zygote):
    forks, env = zygote
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        fd = s.fileno()
        child = run(forks, env, fds=(fd,))
        out = json.loads(child.stdout.readline())
    assert child.wait(30) == 0
    assert fd in out["fds"] and len(out["fds"]) == 5       # 0, 1, 2, listdir's, the socket


def test_what_cannot_be_forked_faithfully_is_not(zygote):
    forks, env = zygote
    assert forks.spawn([sys.executable, "-c", "print(1)"], env) is None     # not -m
    assert forks.spawn(["/bin/true"], env) is None
    other = env | {"OMP_NUM_THREADS": "7"}      # read by libraries the zygote imported
    assert forks.spawn([sys.executable, "-m", "probe"], other) is None
    huge = [sys.executable, "-m", "probe", "x" * (forks.room["argv_room"] + 1)]
    assert forks.spawn(huge, env) is None      # no room to show it in /proc/PID/cmdline


def test_a_dead_zygote_takes_its_children_and_is_started_again(zygote):
    forks, env = zygote
    child = run(forks, env, "--wait")
    json.loads(child.stdout.readline())
    forks.popen.kill()
    assert child.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child.pid}/status") and "zombie" not in open(
            f"/proc/{child.pid}/status").read().lower() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() < deadline                      # the child is dead too
    assert forks.spawn([sys.executable, "-m", "probe"], env) is None   # Popen this time
    assert forks.wait_ready(90) and forks.alive               # a new zygote
    assert run(forks, env).wait(30) == 0


def test_the_meshes_of_one_process_share_a_zygote_that_outlives_each(tiny_target,
                                                                     monkeypatch):
    """A test run starts dozens of meshes in one process: each forks from the zygote the
    first one started (no second ~3.4 s import), which a mesh's stop leaves running although
    the supervisor thread that asked for it is gone (PDEATHSIG follows the keeper thread).
    pytest's per-test variable does not part them; another environment gets its own
    zygote, and the idle one is stopped (each holds ~300 MB)."""
    from pdmesh.local.cluster import Cluster
    from pdmesh.local.forks import Forked

    def mesh(env: str):
        # an environment of this test's own: a mesh that another module of this worker
        # keeps (a session fixture) holds children in the zygote of the usual one
        return Cluster(str(tiny_target), prefill=0, decode=1, gateway=False, echo=False,
                       fork_server=True, extra_env={"TEST_FORKS_ENV": env})

    with mesh("a") as first:
        forks = first.forks
        zygote = forks.popen.pid
        assert isinstance(first.procs["decode-0"].popen, Forked)
    time.sleep(0.5)                    # a PDEATHSIG would have landed by now
    assert forks.alive                 # not exited (a zombie would pass os.kill(pid, 0))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/next.py::test_next (setup)")
    with mesh("a") as second:
        assert second.forks.popen.pid == zygote
        assert isinstance(second.procs["decode-0"].popen, Forked)
    with mesh("b") as third:
        assert third.forks is not forks and isinstance(third.procs["decode-0"].popen, Forked)
        assert not forks.alive
