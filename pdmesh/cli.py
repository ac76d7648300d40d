"""pdmesh command line: up | serve | config | status | tail | generate | bench.

    pdmesh up [--model PATH] [--prefill 1] [--decode 1] [--port 8000]
    pdmesh serve [PATH] [--max-model-len N] [--api-key KEY] [--config FILE]  (vLLM's flags)
    pdmesh config [SERVICE]      every field --set and --config can set, with its default
    pdmesh status [--nats-url nats://127.0.0.1:4222]
    pdmesh tail [--subject 'pdmesh.>']
    pdmesh generate --model PATH "prompt"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from pdmesh.local import control, serve_args
from shared import subjects

DEFAULT_NATS_URL = os.environ.get("PDMESH_NATS_URL")   # None: the running pdmesh up's


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
    sub = ap.add_subparsers(dest="command",
                            metavar="{up,serve,config,restart,status,tail,generate,bench}")

    serve_args.add_up_parsers(sub, cmd_up)
    cf = sub.add_parser("config", help="list every service setting (--set SERVICE.FIELD=V, "
                                       "--config) with its default and help")
    cf.add_argument("service", nargs="?", choices=serve_args.SERVICES,
                    help="only this service's (default: every service's)")
    cf.set_defaults(func=cmd_config)
    control.add_parsers(sub)             # restart: a rolling restart of a running mesh

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
    gen.add_argument("--model", required=True,
                     help="HF model folder, or a Hugging Face id in the local cache")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="render the prompt as a user turn with the chat template (default)")
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                     default="auto", help="auto: bfloat16, as the services (default: auto)")
    gen.add_argument("--quantization", choices=("auto", "none", "int8", "int4"),
                     default="auto", help="weights of the linear layers, as `pdmesh serve "
                     "--help` says (default: auto: a GGUF's own precision, else int4)")
    gen.add_argument("--threads", type=int, default=0,
                     help="torch threads (default: 0, torch's own)")
    gen.set_defaults(func=cmd_generate)

    be = sub.add_parser("bench", help="load generator against a running gateway",
                        add_help=False)
    be.add_argument("rest", nargs=argparse.REMAINDER)
    be.set_defaults(func=lambda a: run_bench(a.rest))
    return ap


# ---- up ------------------------------------------------------------------------------------
def cmd_up(args) -> int:
    from pdmesh.local import up

    return up.run(args)


# ---- status --------------------------------------------------------------------------------
def cmd_status(args) -> int:
    return asyncio.run(_status(args))


def where(nats_url: str | None):
    """(url, NatsAuth) to reach the mesh: --nats-url / PDMESH_NATS_URL with PDMESH_NATS_*,
    else the running pdmesh up's run record, as its read-only debug user."""
    from pdmesh.local import runrecord
    from shared.natsconn import NatsAuth

    if nats_url:
        return nats_url, NatsAuth.from_env()
    rec = runrecord.find()
    if rec is None:
        return "nats://127.0.0.1:4222", NatsAuth.from_env()
    return rec["nats_url"], runrecord.debug_auth(rec)


async def _status(args) -> int:
    from shared import micro

    url, auth = where(args.nats_url)
    try:
        nc = await micro.connect_once(url, auth=auth)
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

    from shared.natsconn import connect_kwargs

    async def on_error(e) -> None:
        print(f"# nats: {e!r}", file=sys.stderr, flush=True)

    url, auth = where(args.nats_url)
    try:   # then keep reconnecting: tail outlives a nats-server restart
        nc = await asyncio.wait_for(nats.connect(
            **connect_kwargs(url, auth), connect_timeout=2,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            error_cb=on_error), 5)
    except (asyncio.TimeoutError, OSError) as e:
        print(f"pdmesh: cannot reach nats at {url}: {e!r}", file=sys.stderr)
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
    print(f"# listening on {args.subject} at {url}", file=sys.stderr, flush=True)
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

    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    quantize = "" if args.quantization == "none" else args.quantization
    engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, threads=args.threads,
                                    quantize=quantize))
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


# ---- config --------------------------------------------------------------------------------
def cmd_config(args) -> int:
    from pdmesh.local.overrides import describe

    for i, service in enumerate([args.service] if args.service else serve_args.SERVICES):
        print(("\n" if i else "") + "\n".join(describe(service)))
    return 0


# ---- bench ---------------------------------------------------------------------------------
def run_bench(argv: list[str]) -> int:
    from pdmesh.bench import run as bench

    return bench.main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
