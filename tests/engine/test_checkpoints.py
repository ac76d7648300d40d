"""Bad checkpoints fail at load time with a message that names the problem."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.loader import CheckpointError

from .random_models import make_random_model


@pytest.fixture
def good(tmp_path):
    return make_random_model(tmp_path / "good", "llama")


def load(path):
    return LLMEngine(EngineConfig(model=str(path), num_blocks=8), tokenizer=None)


def test_missing_tensor(good):
    w = load_file(good / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, good / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors.*layers.1.mlp.up_proj"):
        load(good)


def test_wrong_shape(good):
    w = load_file(good / "model.safetensors")
    w["model.layers.0.self_attn.k_proj.weight"] = w["model.layers.0.self_attn.k_proj.weight"][:8]
    save_file(w, good / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \(8, 128\), config implies \(64, 128\)"):
        load(good)


def test_unsupported_architecture(good):
    cfg = json.loads((good / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (good / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load(good)


def test_no_weights(good):
    (good / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load(good)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)


def test_sharded_checkpoint_loads(good, tmp_path):
    w = load_file(good / "model.safetensors")
    names = sorted(w)
    half = len(names) // 2
    out = tmp_path / "sharded"
    shutil.copytree(good, out)
    (out / "model.safetensors").unlink()
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: w[n] for n in ns}, out / f)
    index = {"weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load(out).model_cfg.num_layers == 3
