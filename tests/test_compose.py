"""compose.yaml is valid and consistent with the code it runs.

Needs Debian's `docker-compose` (apt-get install docker-compose; `make test` installs it);
`docker-compose config` validates and normalises the file without a Docker engine.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdmesh.deploy.creds import write_compose
from pdmesh.deploy.natsconf import COMPOSE_NODES, compose_conf
from pdmesh.local.cluster import CONFIG_CLASSES, config_class, nats_server_binary
from shared.settings import env_name, field_names, flat_values, load

ROOT = Path(__file__).resolve().parents[1]
SERVICES = sorted(CONFIG_CLASSES)


@pytest.fixture(scope="module")
def compose() -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: apt-get install -y docker-compose (make test does)"
    r = subprocess.run([exe, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"docker-compose config failed:\n{r.stderr}"
    return yaml.safe_load(r.stdout)


def test_compose_runs_nats_and_every_service(compose):
    assert set(compose["services"]) == {*COMPOSE_NODES, *SERVICES, "jobstream"}


def test_the_job_stream_is_provisioned_by_the_admin_alone(compose):
    """The keeper container connects as the admin user (no service may write the stream's
    config: tests/test_job_stream.py) and every service that uses the stream waits for it."""
    keeper = compose["services"]["jobstream"]
    assert keeper["command"] == ["python", "-m", "pdmesh.deploy.streamkeeper"]
    assert importlib.util.find_spec("pdmesh.deploy.streamkeeper") is not None
    assert keeper["environment"]["PDMESH_NATS_USER"] == "admin"
    assert keeper["secrets"] == [{"source": "admin_nats_password", "target": "nats_password"}]
    assert compose["secrets"]["admin_nats_password"]["file"].endswith("/admin.password")
    for name in ("prefill", "decode"):
        assert "jobstream" in compose["services"][name]["depends_on"], name


@pytest.mark.parametrize("service", SERVICES)
def test_service_command_is_its_module(compose, service):
    svc = compose["services"][service]
    assert svc["command"] == ["python", "-m", f"services.{service}"]
    config_class(service)
    assert importlib.util.find_spec(f"services.{service}.__main__") is not None, \
        f"services/{service}/__main__.py is missing"


@pytest.mark.parametrize("service", SERVICES)
def test_service_env_names_config_fields(compose, service, monkeypatch, tmp_path):
    cls = config_class(service)
    env = compose["services"][service].get("environment") or {}
    fields = {env_name(name): name for name in field_names(cls)}
    unknown = sorted(set(env) - set(fields))
    assert not unknown, f"{service}: {unknown} match no field of {cls.__name__} ({sorted(fields)})"
    # and the values parse: the config builds from exactly this environment
    for k in list(os.environ):
        if k.startswith("PDMESH_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        if v.startswith("/run/secrets/"):        # a mounted secret: a file of that kind here
            secret = tmp_path / Path(v).name
            secret.write_text("sk-test\n" if "api_key" in k.lower() else "pw\n")
            env = env | {k: str(secret)}
            v = str(secret)
        monkeypatch.setenv(k, str(v))
    cfg = flat_values(load(cls, argv=[]))
    for k, v in env.items():
        assert str(cfg[fields[k]]).lower() == str(v).lower(), k


@pytest.mark.parametrize("service", SERVICES)
def test_service_health_check_asks_that_service(compose, service):
    test = compose["services"][service]["healthcheck"]["test"]
    assert test == ["CMD", "python", "-m", "pdmesh.deploy.healthcheck", service]


def test_scaling_needs_no_fixed_names_or_ports(compose):
    for name, svc in compose["services"].items():
        assert "container_name" not in svc, name
        assert "PDMESH_INSTANCE_ID" not in (svc.get("environment") or {}), name
        if name != "gateway":
            assert not svc.get("ports"), f"{name} publishes a host port"
    ports = compose["services"]["gateway"]["ports"]
    assert ports and all(str(p).split("/")[0].endswith(":8000:8000") for p in ports), ports
    # only on this machine unless asked (PDMESH_GATEWAY_BIND)
    assert all(str(p).startswith("127.0.0.1:") for p in ports), ports


def test_dependencies_wait_for_health(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in services[dep], dep
    for name in SERVICES:     # every service waits for the whole NATS cluster
        if name != "gateway":
            assert set(COMPOSE_NODES) <= set(services[name]["depends_on"]), name


def test_nats_is_a_three_node_jetstream_cluster_with_8mb_payload(compose, tmp_path):
    conf = ROOT / "deploy" / "nats.conf"
    assert conf.read_text() == compose_conf(), "deploy/nats.conf: regenerate from compose_conf()"
    text = conf.read_text()
    assert re.search(r"^max_payload:\s*8MB", text, re.M)
    assert re.search(r"^jetstream\s*\{", text, re.M)
    write_compose(tmp_path)          # what `python -m pdmesh.deploy.creds deploy/secrets` writes
    shutil.copy(conf, tmp_path / "nats.conf")
    routes = (tmp_path / "routes.conf").read_text()
    for node in COMPOSE_NODES:
        nats = compose["services"][node]
        assert nats["image"] == compose["services"]["decode"]["image"]   # the wheel's server
        assert nats["command"][0] == "nats-server"
        assert nats["environment"]["SERVER_NAME"] == node
        mounts = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
        assert mounts["/etc/nats/pdmesh.conf"] == str(conf)
        for secret in ("auth.conf", "routes.conf"):       # included by nats.conf, generated
            assert mounts[f"/etc/nats/{secret}"] == str(ROOT / "deploy" / "secrets" / secret)
        assert re.search(rf"nats-route://route:[^@]+@{node}:6222", routes)
        r = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"],
                           capture_output=True, text=True, timeout=30,
                           env=os.environ | {"SERVER_NAME": node})
        assert r.returncode == 0, r.stderr + r.stdout
    assert len({str(compose["services"][n]["volumes"]) for n in COMPOSE_NODES}) == 3  # own stores


def test_every_service_is_given_every_nats_server(compose):
    for name in (*SERVICES, "jobstream"):
        url = compose["services"][name]["environment"]["PDMESH_NATS_URL"]
        assert url.split(",") == [f"nats://{n}:4222" for n in COMPOSE_NODES], name


def test_image_holds_the_model_compose_serves(compose):
    dockerfile = (ROOT / "Dockerfile").read_text()
    models = {svc["environment"]["PDMESH_MODEL"] for svc in compose["services"].values()
              if "PDMESH_MODEL" in (svc.get("environment") or {})}
    assert len(models) == 1
    assert f"gguf_convert --out {models.pop()}" in dockerfile
    for pkg in ("pdmesh", "shared", "services", "kernels"):
        assert re.search(rf"^COPY {pkg} ", dockerfile, re.M), f"Dockerfile does not copy {pkg}/"
    assert "download.pytorch.org/whl/cpu" in dockerfile


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_connects_as_its_own_nats_user(compose, service):
    svc = compose["services"][service]
    env = svc["environment"]
    assert env["PDMESH_NATS_USER"] == service
    assert env["PDMESH_NATS_PASSWORD_FILE"] == "/run/secrets/nats_password"
    assert svc["secrets"][0] == {"source": f"{service}_nats_password", "target": "nats_password"}
    assert svc["secrets"][1:] == ([{"source": "api_keys", "target": "api_keys"}]
                                  if service == "gateway" else [])
    secret = compose["secrets"][f"{service}_nats_password"]["file"]
    assert secret == str(ROOT / "deploy" / "secrets" / f"{service}.password")
    assert "PDMESH_NATS_PASSWORD" not in env           # never a password in the file itself
