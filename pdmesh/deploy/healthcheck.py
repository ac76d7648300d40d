"""Container health check: python -m pdmesh.deploy.healthcheck <service>  (exit 0 healthy, 1 not).

gateway: GET http://127.0.0.1:$PDMESH_PORT/ready must answer 200 (it serves: a decode
         instance, and a prefill worker where decode needs one, are there).
nats:    the node's monitoring port answers /healthz?js-enabled-only=true (JetStream on).
jobstream: the job stream exists with exactly its configuration (pdmesh.deploy.streamkeeper).
others:  a Health request on the service's own subject, health(<service>, <instance>),
         must answer ok. The instance id is --instance-id, else $PDMESH_INSTANCE_ID,
         else found by $SRV.PING: generated ids are `<service>_<hostname>_<random>`
         (shared.service.new_instance_id), and a container's hostname is its own, so
         `docker compose up --scale decode=2` needs no fixed ids.
Imports no torch: it runs every few seconds in every container.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import urllib.request

from shared import subjects

SERVICES = ("gateway", "decode", "prefill", "kvstore")


def check_http(port: int, timeout_s: float, path: str = "/ready") -> str | None:
    """None when healthy, else why not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return None if r.status == 200 else f"{path} answered {r.status}"
    except Exception as e:  # noqa: BLE001
        return f"{path}: {e}"


async def check_nats(service: str, nats_url: str, instance_id: str | None,
                     timeout_s: float) -> str | None:
    import msgspec

    from shared import micro
    from shared.contracts.messages import Health

    try:
        nc = await micro.connect_once(nats_url, timeout_s)
    except ConnectionError as e:
        return str(e)
    try:
        if not instance_id:
            mine = subjects.instance_token(f"{service}_{socket.gethostname()}_")
            found = [i.instance_id for i in await micro.ping(nc, service)
                     if i.instance_id.startswith(mine)]
            if not found:
                return f"no {service} instance named {mine}* answers $SRV.PING"
            instance_id = found[0]
        try:
            msg = await nc.request(subjects.health(service, instance_id), b"", timeout=timeout_s)
        except Exception as e:  # noqa: BLE001
            return f"{service} {instance_id}: no health reply ({e!r})"
        try:
            health = msgspec.json.decode(msg.data, type=Health)
        except msgspec.DecodeError as e:
            return f"{service} {instance_id}: bad health reply ({e})"
        return None if health.ok else f"{service} {instance_id}: not ok (shutting down?)"
    finally:
        await nc.close()


async def check_stream(nats_url: str, timeout_s: float) -> str | None:
    from shared import jobstream, micro

    try:
        nc = await micro.connect_once(nats_url, timeout_s)
    except ConnectionError as e:
        return str(e)
    try:
        changed = await jobstream.stream_drift(nc.jetstream(timeout=timeout_s))
        return f"job stream differs in {', '.join(changed)}" if changed else None
    except Exception as e:  # noqa: BLE001 - missing, no JetStream
        return f"job stream: {e!r}"
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.deploy.healthcheck",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("service", choices=(*SERVICES, "jobstream", "nats"))
    ap.add_argument("--nats-url", default=os.environ.get("PDMESH_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--instance-id", default=os.environ.get("PDMESH_INSTANCE_ID") or None)
    ap.add_argument("--port", type=int, default=int(os.environ.get("PDMESH_PORT", "8000")),
                    help="gateway HTTP port")
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args(argv)
    if args.service == "gateway":
        why = check_http(args.port, args.timeout)
    elif args.service == "nats":
        why = check_http(8222, args.timeout, "/healthz?js-enabled-only=true")
    elif args.service == "jobstream":
        why = asyncio.run(check_stream(args.nats_url, args.timeout))
    else:
        why = asyncio.run(check_nats(args.service, args.nats_url, args.instance_id, args.timeout))
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
