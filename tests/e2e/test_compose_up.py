"""`docker compose up` serves (issue 30): the image built as scripts/image.sh builds it (a
debootstrapped base where no registry is reachable, wheels from constraints.txt), the
credentials as `python -m pdmesh.deploy.creds` writes them, compose.yaml as it is (3 clustered
nats-servers from the image, the job stream keeper, kvstore, prefill, decode, gateway, API
key as a secret), then the official `openai` client: a chat, a tool call with
tool_choice="required" across PD, a stream. Torn down (volumes too) at the end.

Needs a container engine: dockerd is started when this is root and none runs; elsewhere
the module is skipped with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from pdmesh.deploy.creds import api_key
from pdmesh.local.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _engine() -> str | None:
    """Why no container engine can run here, or None (dockerd started if need be)."""
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker / docker-compose not installed (make test installs docker-compose)"
    ok = lambda: subprocess.run(["docker", "info"], capture_output=True).returncode == 0  # noqa: E731
    if ok():
        return None
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        return "no docker daemon, and this is not root to start one"
    subprocess.Popen(["dockerd"], stdout=open("/tmp/pdmesh-dockerd.log", "ab"),
                     stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(60):
        if ok():
            return None
        time.sleep(0.5)
    return "dockerd did not start (/tmp/pdmesh-dockerd.log)"


WHY = _engine()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no container engine: {WHY}")


def _ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=3) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/ready not 200 in {timeout_s:.0f} s")
        time.sleep(1)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / "scripts" / "image.sh")], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\nimage: {time.monotonic() - t0:.0f} s; {r.stdout.strip().splitlines()[-1]}")
    secrets = tmp_path_factory.mktemp("compose") / "secrets"
    subprocess.run(["python3" if not (ROOT / ".venv").exists() else str(ROOT / ".venv/bin/python"),
                    "-m", "pdmesh.deploy.creds", str(secrets)], cwd=ROOT, check=True,
                   capture_output=True)
    port = free_port()
    env = os.environ | {"PDMESH_SECRETS": str(secrets), "PDMESH_GATEWAY_PORT": str(port)}
    project = f"pdmeshtest{os.getpid()}"
    compose = ["docker-compose", "-p", project]
    try:
        t0 = time.monotonic()
        r = subprocess.run([*compose, "up", "-d"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        url = f"http://127.0.0.1:{port}"
        _ready(url, 300)
        print(f"compose up: serving in {time.monotonic() - t0:.0f} s")
        yield url, api_key(secrets), compose, env
    finally:
        logs = subprocess.run([*compose, "logs", "--tail", "30"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120).stdout
        subprocess.run([*compose, "down", "-v", "--timeout", "10"], cwd=ROOT, env=env,
                       capture_output=True, timeout=300)
        if os.environ.get("PDMESH_COMPOSE_LOGS"):
            print(logs)


@pytest.fixture(scope="module")
def client(mesh):
    from openai import OpenAI

    url, key, _, _ = mesh
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _states(compose, env) -> list[dict]:
    ids = subprocess.run([*compose, "ps", "-q"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True,
                                     text=True, check=True).stdout)


def test_every_container_is_healthy(mesh):
    """Each health check means ready (the gateway's: /ready); within 60 s of serving."""
    _, _, compose, env = mesh
    deadline = time.monotonic() + 60
    while True:
        states = _states(compose, env)
        health = {s["Name"].lstrip("/"): s["State"].get("Health", {}).get("Status")
                  for s in states}
        if set(health.values()) == {"healthy"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(health) == 8, health           # 3 nats, jobstream, kvstore, prefill, decode, gw
    assert set(health.values()) == {"healthy"}, health
    users = {s["Name"].lstrip("/"): s["Config"]["User"] for s in states}
    assert set(users.values()) == {"pdmesh"}, users      # nothing runs as root


def test_the_api_key_is_required(mesh):
    url, _, _, _ = mesh
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/v1/models", timeout=10)
    assert e.value.code == 401


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert r.choices[0].message.content.strip()
    assert r.usage.completion_tokens > 0


def test_a_required_tool_call_across_pd(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0,
        extra_body={"pdmesh_path": "pd"})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)


def test_a_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=32, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def _in_image(probe: str) -> subprocess.CompletedProcess:
    """`python -c probe` in a fresh container of the image (its user, its workdir)."""
    image = os.environ.get("PDMESH_IMAGE", "pdmesh:local")
    r = subprocess.run(["docker", "run", "--rm", image, "python", "-c", probe],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_the_image_carries_no_test_lint_or_gpu_package(mesh):
    """The runtime image holds what the services import and nothing of development
    (pytest, ruff, hypothesis, the API clients the tests use, jsonschema, matplotlib) or of
    the GPU (triton: xgrammar needs it only for CUDA logits; the required tool call above
    ran its grammar without it)."""
    probe = ("import importlib.util as u; print(sorted(m for m in ('pytest', 'ruff', "
             "'hypothesis', 'openai', 'anthropic', 'jsonschema', 'matplotlib', 'triton') "
             "if u.find_spec(m)) or 'none'); import xgrammar, shared.engine.grammar")
    r = _in_image(probe)
    assert r.stdout.strip() == "none", r.stdout


def test_the_image_loads_its_prebuilt_ops_and_carries_no_compiler(mesh):
    """The C++ CPU ops were built for CPU_ARCH at build time and load as they are (a service
    that found none would warn and fall back to the slower torch path); the compiler that
    built them is gone (the image builds them and removes g++ in one layer)."""
    probe = ("import shutil; from kernels.cpu_ops.build import load, build_dir; "
             "print(sorted(c for c in ('g++', 'gcc', 'cc', 'c++', 'cpp') if shutil.which(c)) "
             "or 'none', load() is not None, build_dir())")
    r = _in_image(probe)
    compilers, loaded, where = r.stdout.split()
    assert compilers == "none", r.stdout
    assert loaded == "True", r.stdout + r.stderr[-2000:]
    assert where.startswith("/opt/pdmesh-ext/"), where


def test_the_services_find_the_bytecode_of_what_they_load(mesh):
    """pip installs the image's packages with --no-compile, and pdmesh.deploy.bytecode
    compiles what the services load: a service (which cannot write into the root-owned
    venv) compiles nothing at start, nor does each health check. Python says "could not
    create" for every module it had to compile and could not cache."""
    _, _, compose, env = mesh
    name = next(s["Name"].lstrip("/") for s in _states(compose, env) if "decode" in s["Name"])
    for cmd in (["python", "-m", "pdmesh.deploy.healthcheck", "decode"],
                ["python", "-m", "pdmesh.deploy.bytecode", "/models/SmolLM2-135M-Instruct"]):
        r = subprocess.run(["docker", "exec", "-e", "PYTHONVERBOSE=1", name, *cmd],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        uncached = [ln for ln in r.stderr.splitlines() if "could not create" in ln]
        assert not uncached, f"{len(uncached)} modules compiled at start: {uncached[:5]}"
