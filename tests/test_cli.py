"""The pdmesh command line: help, generate, bench help, --set parsing, status and tail
formatting."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdmesh import cli
from pdmesh.local import up
from pdmesh.local.overrides import parse_sets
from shared.micro import Instance

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "models" / "tiny-target"


def pdmesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_subcommand():
    r = pdmesh("--help")
    assert r.returncode == 0, r.stderr
    for sub in ("up", "serve", "config", "status", "tail", "generate", "bench"):
        assert sub in r.stdout


def test_up_help_names_its_options():
    out = pdmesh("up", "--help").stdout
    for flag in ("--model", "--prefill", "--decode", "--port", "--nats-port", "--mode",
                 "--deterministic", "--extra-env", "--max-model-len", "--api-key", "--config"):
        assert flag in out


@pytest.mark.skipif(not (TINY_TARGET / "model.safetensors").is_file(),
                    reason="models/tiny-target not trained (scripts/train_models.py)")
@pytest.mark.parametrize("chat", ["--chat", "--no-chat"])
def test_generate_prints_text(chat):
    # no --threads (torch's default) and int4 weights, as serve's default
    r = pdmesh("generate", "--model", str(TINY_TARGET), "--max-tokens", "4", chat,
               "def fibonacci(n):")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text generated"


def test_bench_help_is_bench_s_own():
    r = pdmesh("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "pdmesh bench" in r.stdout and "--spawn" in r.stdout


def test_set_values_parse_per_service_and_instance():
    assert parse_sets(["decode.num_blocks=64", "decode-0.fault-repeat-loop=true",
                       "prefill.kv_window=8"]) == {
        "decode": {"num_blocks": "64"}, "decode-0": {"fault_repeat_loop": True},
        "prefill": {"kv_window": "8"}}
    with pytest.raises(SystemExit):
        parse_sets(["num_blocks=64"])


def test_status_without_nats_fails_clearly():
    r = pdmesh("status", "--nats-url", "nats://127.0.0.1:1", timeout=30)
    assert r.returncode == 1 and "cannot reach nats" in r.stderr


def test_status_table_shows_blocks_and_queue():
    rows = cli.format_status([
        Instance("decode", "x", "decode_0", stats={"running": 2, "waiting": 1, "blocks_free": 90,
                                                   "blocks_used": 10, "awaiting_kv": 3}),
        Instance("kvstore", "y", "kvstore_0", stats={"entries": 0})]).splitlines()
    assert rows[0].split()[:2] == ["SERVICE", "INSTANCE"]
    assert rows[1].split() == ["decode", "decode_0", "2", "1", "90/10", "3", "0", "0"]
    assert rows[2].split()[:3] == ["kvstore", "kvstore_0", "-"]


def test_tail_prints_json_bodies_and_only_headers_of_binary_ones():
    ctl = SimpleNamespace(subject="pdmesh.decode.abort.d0", reply="", headers=None,
                          data=b'{"v":1,"request_id":"r1"}')
    kv = SimpleNamespace(subject="pdmesh.decode.kv.d0", reply="_INBOX.1",
                         headers={"request_id": "r1", "epoch": "3"}, data=bytes(range(256)) * 4)
    line = cli.format_msg(ctl)
    assert line.endswith('pdmesh.decode.abort.d0 {"v":1,"request_id":"r1"}')
    line = cli.format_msg(kv)
    assert "<1024 bytes binary>" in line and '"epoch": "3"' in line and "reply=_INBOX.1" in line


def test_tail_hides_heartbeats_by_pattern():
    assert cli._matches("pdmesh.evt.*.heartbeat", "pdmesh.evt.decode.heartbeat")
    assert not cli._matches("pdmesh.evt.*.heartbeat", "pdmesh.evt.request.aborted")
    assert cli._matches("pdmesh.>", "pdmesh.decode.kv.d0")


@pytest.mark.parametrize("status,body,hint,model", [
    (200, b'{"object": "list", "data": [{"id": "SmolLM2"}]}', "API keys: OFF", "SmolLM2"),
    (200, b'{"data": []}', "API keys: OFF", None),
    (401, b'{"error": {}}', "API keys: ON", None),
    (500, b"", "API keys: unknown (the gateway answered HTTP 500)", None),
])
def test_the_ready_banner_reads_keys_and_model_from_one_request(status, body, hint, model):
    """`pdmesh up`'s banner: whether the gateway wants an API key and the model it serves,
    from one unauthenticated GET /v1/models."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = []

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got_hint, got_model = up._probe(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    assert got_hint.startswith(hint) and got_model == model and seen == ["/v1/models"]
    assert up._probe("http://127.0.0.1:9")[0] == "API keys: unknown (the gateway did not answer)"
