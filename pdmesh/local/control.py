"""`pdmesh restart SERVICE`: ask the running `pdmesh up` for a rolling restart.

`pdmesh up` listens on a Unix socket in its run directory (a mkdtemp folder, mode 0700: only
its user reaches it), named in its run record (pdmesh.local.runrecord). The client sends one JSON
line, {"cmd": "restart", "service": "decode"}; the mesh answers with JSON lines, each
{"line": "..."} as a step is done, and last {"ok": true} or {"error": "..."}.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

from pdmesh.local import runrecord
from pdmesh.local.rolling import restart_service

SERVICES = ("gateway", "decode", "prefill", "kvstore", "nats")


def add_parsers(sub) -> None:
    rs = sub.add_parser("restart", help="rolling restart of one service of the running mesh "
                                        "(one instance at a time; no request fails)")
    rs.add_argument("service", choices=SERVICES)
    rs.add_argument("--run", type=int, default=None, metavar="PID",
                    help="the pdmesh up to ask (default: the newest running one)")
    rs.set_defaults(func=cmd_restart)


# ---- client -----------------------------------------------------------------------------
def cmd_restart(args) -> int:
    rec = runrecord.find(args.run)
    if rec is None or not rec.get("control"):
        print(f"pdmesh: no running pdmesh up found in {runrecord.run_dir()}", file=sys.stderr)
        return 1
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(rec["control"])
        except OSError as e:
            print(f"pdmesh: cannot reach pdmesh up (pid {rec['pid']}): {e}", file=sys.stderr)
            return 1
        s.sendall(json.dumps({"cmd": "restart", "service": args.service}).encode() + b"\n")
        for raw in s.makefile("rb"):
            msg = json.loads(raw)
            if "line" in msg:
                print(f"pdmesh: {msg['line']}", flush=True)
            elif msg.get("ok"):
                print(f"pdmesh: {args.service}: rolling restart done", flush=True)
                return 0
            else:
                print(f"pdmesh: {args.service}: {msg.get('error')}", file=sys.stderr)
                return 1
    print("pdmesh: pdmesh up closed the connection", file=sys.stderr)
    return 1


# ---- server (on the cluster's supervisor loop) ------------------------------------------------
async def serve(cluster, path: Path) -> asyncio.AbstractServer:
    lock = asyncio.Lock()            # one rolling restart at a time

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def send(msg: dict) -> None:
            writer.write(json.dumps(msg).encode() + b"\n")
        try:
            req = json.loads(await reader.readline())
            if req.get("cmd") != "restart" or req.get("service") not in SERVICES:
                raise ValueError(f"unknown request {req!r}")
            async with lock:
                await restart_service(cluster, req["service"], lambda s: send({"line": s}))
            send({"ok": True})
        except Exception as e:  # noqa: BLE001 - told to the client, the mesh keeps running
            send({"error": f"{type(e).__name__}: {e}"})
        finally:
            try:
                await writer.drain()
            finally:
                writer.close()
    return await asyncio.start_unix_server(handle, path=str(path))
