"""pdmesh bench end to end in seconds: a real nats-server, a fake gateway (SSE with
token ids and x-pdmesh-path) and a fake prefill answering $SRV.STATS with KV counters.
Checks the JSON and PNG, the ratios, and that a wrong path header is caught."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from pdmesh import bench
from pdmesh.cluster import Cluster, free_port
from shared.service import ServiceRuntime

pytestmark = pytest.mark.timeout(60)
WRITE = 48 << 10


class FakeMesh:
    """Gateway + prefill stand-ins on their own loop (bench.main runs its own)."""

    def __init__(self, nats_url: str, lie_about_path: bool = False):
        self.nats_url = nats_url
        self.port = free_port()
        self.lie = lie_about_path
        self.counters = {"jobs_done": 0, "kv_writes": 0, "kv_bytes": 0, "kv_transfer_s": 0.0,
                         "kv_max_write_bytes": 0, "kv_window": 8}
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def models(self, _req):
        return web.json_response({"object": "list", "data": [
            {"id": "fake/model", "object": "model", "max_model_len": 1024}]})

    async def completions(self, req):
        body = await req.json()
        ptoks = len(body["prompt"].split())
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": {
                "prompt_tokens": ptoks, "completion_tokens": 1}})
        path = body["pdmesh_path"]
        if path == "pd":   # what a prefill would have counted
            writes = max(1, ptoks // 16)
            self.counters["jobs_done"] += 1
            self.counters["kv_writes"] += writes
            self.counters["kv_bytes"] += writes * WRITE
            self.counters["kv_transfer_s"] += writes * 0.0005
            self.counters["kv_max_write_bytes"] = WRITE
        shown = "colocated" if self.lie and path == "pd" else path
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-pdmesh-path": shown})
        await resp.prepare(req)
        n = body["max_tokens"]
        for i in range(0, n, 2):       # two tokens per chunk, like a busy decode
            k = min(2, n - i)
            chunk = {"choices": [{"index": 0, "text": "ab"[:k], "token_ids": [7] * k}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.002)
        await resp.write(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n')
        usage = {"prompt_tokens": ptoks, "completion_tokens": n, "total_tokens": ptoks + n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                         + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _start(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.rt = ServiceRuntime("prefill", "prefill_0", self.nats_url,
                                 stats=lambda: dict(self.counters))
        await self.rt.start()

    async def _stop(self):
        await self.rt.close()
        await self.runner.cleanup()

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(20)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def nats_only():
    with Cluster(model="unused", prefill=0, decode=0, gateway=False, kvstore=False,
                 echo=False) as c:
        yield c


def _argv(c, fake, out) -> list[str]:
    return ["--url", f"http://127.0.0.1:{fake.port}", "--nats-url", c.nats_url,
            "--concurrency", "1,4", "--requests", "4", "--max-tokens", "9",
            "--long-tokens", "200", "--long-requests", "2", "--raw-mb", "2", "--out", str(out)]


def test_bench_writes_json_png_ratios_and_raw_baseline(nats_only, tmp_path, capsys):
    with FakeMesh(nats_only.nats_url) as fake:
        assert bench.main(_argv(nats_only, fake, tmp_path)) == 0
    res = json.loads((tmp_path / "mesh_fake_model.json").read_text())
    assert (tmp_path / "mesh_fake_model.png").stat().st_size > 10_000
    for p in ("pd", "colocated"):
        for c in ("1", "4"):
            r = res["runs"][p][c]
            assert r["ok"] == 4 and r["errors"] == 0 and r["path_mismatch"] == 0
            assert r["completion_tokens"] == 36 and r["tokens_per_s"] > 0
            assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p90"]
            assert r["itl_s"]["n"] == 4 * 4        # 5 chunks per request -> 4 gaps
        assert res["long"][p]["prompt_tokens_mean"] > 150
    kv = res["kv"]
    assert kv["window"] == 8
    assert kv["short"]["mean_write_bytes"] == WRITE and kv["long"]["kv_writes"] >= 2 * 9
    assert kv["all"]["bytes_per_s"] == pytest.approx(WRITE / 0.0005)
    assert {(r["payload_bytes"], r["window"]) for r in kv["raw_nats"]} == {(WRITE, 8), (WRITE, 1)}
    assert all(r["bytes_per_s"] > 0 for r in kv["raw_nats"])
    assert res["ratios"]["kv_vs_raw_nats"] == pytest.approx(
        kv["all"]["bytes_per_s"] / kv["all"]["raw_bytes_per_s"])
    assert res["ratios"]["pd_vs_colocated_ttft_c1"] > 0
    assert set(res["targets"]) == {"pd_c1_ttft_within_1.3x_colocated",
                                   "pd_c1_itl_within_1.3x_colocated",
                                   "kv_transfer_ge_50pct_raw_nats"}
    assert res["config"]["requests_per_level"] == {"1": 4, "4": 4}
    assert res["problems"] == []
    out = capsys.readouterr().out
    assert "pd c=4: 4/4 done" in out and "tok/s" in out


def test_bench_reports_answers_on_the_wrong_path(nats_only, tmp_path):
    with FakeMesh(nats_only.nats_url, lie_about_path=True) as fake:
        argv = _argv(nats_only, fake, tmp_path) + ["--concurrency", "1", "--long-tokens", "0",
                                                   "--raw-mb", "0.5"]
        assert bench.main(argv) == 0
    res = json.loads((tmp_path / "mesh_fake_model.json").read_text())
    assert res["runs"]["pd"]["1"]["path_mismatch"] == 4
    assert res["runs"]["colocated"]["1"]["path_mismatch"] == 0
    assert any("pd c=1: 4 answers on another path" in p for p in res["problems"])
