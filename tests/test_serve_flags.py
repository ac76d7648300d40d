"""`pdmesh up` / `pdmesh serve` flags as service settings: vLLM's flags, the --config file
(the command line wins over it), the fast configuration by default, a mistyped field
refused in one line with the closest valid one, `pdmesh config`."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh import cli
from pdmesh.local.cluster import Cluster
from pdmesh.local.serve_args import SPECULATION, cluster_kwargs

ROOT = Path(__file__).resolve().parents[1]


def kwargs(*argv: str) -> dict:
    return cluster_kwargs(cli.build_parser().parse_args(list(argv)))


def pdmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


SHORT_LOCAL = {"min_pd_prompt_tokens": 1000}     # prompts under 1000 tokens prefill on decode


def test_bare_up_runs_the_fast_configuration():
    kw = kwargs("up")
    assert kw["threads"] == "auto"
    assert kw["overrides"] == {"decode": {"quantize": "auto", "head_split": True, "batch_helper": True} | SPECULATION | SHORT_LOCAL,
                               "prefill": {"quantize": "auto"}}
    assert kwargs("serve") == kw
    c = Cluster(**(kw | {"model": "unused", "echo": False}))   # argv only, not started
    argv = c.new_proc("decode").argv
    assert argv[argv.index("--quantize") + 1] == "auto" and "--head-split" in argv
    assert argv[argv.index("--spec-method") + 1] == "ngram"
    assert argv[argv.index("--spec-max-batch") + 1] == "2"
    assert argv[argv.index("--min-pd-prompt-tokens") + 1] == "1000"
    assert kwargs("up", "--no-speculation")["overrides"]["decode"] == {"quantize": "auto",
                                                                     "head_split": True, "batch_helper": True} \
        | SHORT_LOCAL
    assert kwargs("up", "--min-pd-prompt-tokens", "0")["overrides"]["decode"][
        "min_pd_prompt_tokens"] == 0
    assert "--act-int8" not in argv and "--smoothquant" not in argv


def test_quantization_none_is_the_unquantized_dtype():
    o = kwargs("up", "--quantization", "none")["overrides"]
    assert o == {"decode": {"quantize": "", "head_split": False, "batch_helper": False} | SPECULATION | SHORT_LOCAL,
                 "prefill": {"quantize": ""}}
    o = kwargs("up", "--act-int8", "--dtype", "float32")["overrides"]
    assert o["decode"] == {"quantize": "auto", "head_split": True, "batch_helper": True, "act_int8": True,
                           "smoothquant": True, "dtype": "float32"} | SPECULATION | SHORT_LOCAL


def test_serve_takes_vllm_flags_and_the_command_line_wins_over_the_file(tmp_path):
    f = tmp_path / "f.toml"
    f.write_text('[serve]\nmax-model-len = 1024\nserved_model_name = "from-file"\n'
                 'decode = 2\nenable-prefix-caching = false\n'
                 '[decode]\nnum_blocks = 64\nquantize = "int8"\n[gateway]\nmax_model_len = 999\n')
    kw = kwargs("serve", "models/tiny-target", "--api-key", "a", "--api-key", "b",
                "--max-model-len", "512", "--served-model-name", "tiny",
                "--quantization", "none", "--config", str(f))
    assert kw["model"] == "models/tiny-target" and kw["decode"] == 2
    assert kwargs("serve", "--config", str(f), "--decode", "1")["decode"] == 1   # a default, given
    assert kw["overrides"] == {
        "gateway": {"api_key": "a,b", "served_model_name": "tiny", "max_model_len": 512},
        "decode": {"max_model_len": 512, "quantize": "", "head_split": False, "batch_helper": False,
                   "num_blocks": 64, "prefix_cache": False} | SPECULATION | SHORT_LOCAL,
        "prefill": {"max_model_len": 512, "quantize": "", "prefix_cache": False}}
    # the file's service tables win over the defaults; --set over everything
    o = kwargs("serve", "--config", str(f), "--set", "decode.num_blocks=8")["overrides"]
    assert o["decode"]["quantize"] == "int8" and o["prefill"]["quantize"] == "auto"
    assert o["decode"]["num_blocks"] == "8" and o["gateway"]["max_model_len"] == 999


def test_yaml_config_and_its_mistakes(tmp_path):
    f = tmp_path / "f.yaml"
    f.write_text("serve:\n  quantization: int8\n  api-key: [k1, k2]\nprefill:\n  chunk_size: 128\n")
    o = kwargs("up", "--config", str(f))["overrides"]
    assert o["gateway"] == {"api_key": "k1,k2"} and o["prefill"]["chunk_size"] == 128
    assert o["decode"]["quantize"] == "int8"
    for text, error in [("serve:\n  quantisation: int4\n", "did you mean 'quantization'"),
                        ("serve:\n  quantization: int5\n", "invalid choice: 'int5'"),
                        ("decode: 2\n", "flags go in the [serve] table"),
                        ("decode:\n  num_blokcs: 2\n", "did you mean 'num_blocks'")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=error.replace("[", r"\[")):
            kwargs("up", "--config", str(f))


def test_a_service_s_own_threads_win_over_auto():
    o = kwargs("up", "--decode", "2", "--set", "decode.threads=3")["overrides"]
    assert o["decode-0"] == o["decode-1"] == {"threads": "3"}
    assert "threads" not in o["decode"]
    kw = kwargs("up", "--threads", "2")
    assert kw["threads"] is None and kw["overrides"]["prefill"]["threads"] == 2


def test_the_gateway_checks_requests_against_decode_s_window():
    o = kwargs("up", "--set", "decode.max_model_len=64")["overrides"]
    assert o["gateway"] == {"max_model_len": "64"}


def test_a_mistyped_field_is_one_line_naming_the_closest_and_exit_2():
    r = pdmesh("up", "--set", "decode.num_blokcs=1", "--model", "models/tiny-target")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "pdmesh: decode has no setting 'num_blokcs'; did you mean 'num_blocks'? "
        "(`pdmesh config decode` lists them)"]
    r = pdmesh("serve", "--set", "decod.num_blocks=1")
    assert r.returncode == 2 and "did you mean 'decode'" in r.stderr and "Traceback" not in r.stderr


def test_config_lists_every_field_with_its_default_and_no_fault(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert "decode.num_blocks = 0\n    KV blocks" in out
    assert 'decode.dtype = "bfloat16"' in out and "gateway.max_model_len = 0" in out
    assert "\nkvstore." in out and not re.search(r"^\w+\.fault_", out, re.M)
    assert cli.main(["config", "prefill"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# prefill:") and not re.search(r"^decode\.", out, re.M)


def test_help_shows_defaults():
    out = " ".join(pdmesh("serve", "--help").stdout.split())      # as wrapped at any width
    assert "int4 14.74 (+0.24%)" in out and "(a GGUF file keeps its own precision" in out
    assert "{auto,none,int8,int4} weights of decode's" in out and "(default: auto)" in out
