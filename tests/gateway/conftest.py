"""Gateway fixtures: the served model's spec (tokenizer + context window) and a real
nats-server on a free port."""
from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests import natsserver
from tests.conftest import SMOLLM2_DIR, TINY_TARGET


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


@pytest.fixture(scope="session")
def gateway_model_dir() -> Path:
    """The bundled tiny target once its tokenizer is there, else the converted SmolLM2
    folder. The gateway needs only the tokenizer and config.json, never the weights."""
    for folder in (TINY_TARGET, SMOLLM2_DIR):
        if _has_tokenizer(folder):
            return folder
    pytest.skip("no model folder with a tokenizer (models/tiny-target or SmolLM2)")


@pytest.fixture(scope="session")
def spec(gateway_model_dir):
    from services.gateway.config import GatewayConfig
    from services.gateway.model import ModelSpec

    return ModelSpec.load(GatewayConfig(model=str(gateway_model_dir)))


async def _provision(url: str) -> None:
    """The job stream, as pdmesh up's keeper makes it (services only wait for it)."""
    from pdmesh.deploy.streamkeeper import StreamKeeper

    keeper = StreamKeeper({"servers": [url]})
    await keeper.start()
    await keeper.close()


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    store = tmp_path_factory.mktemp("nats")
    proc, port = natsserver.start("-js", "-sd", str(store))
    url = f"nats://127.0.0.1:{port}"
    asyncio.run(_provision(url))
    yield url
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
