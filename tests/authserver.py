"""A real nats-server with pdmesh's generated users and permissions (pdmesh/deploy/creds.py)."""
from __future__ import annotations

from pdmesh.deploy.creds import Secrets
from tests import natsserver


class AuthServer:
    """A real nats-server (JetStream on) with the generated users and permissions; each
    connection records the permission violations the server reports to it."""

    def __init__(self, tmp_path):
        self.secrets = Secrets.create(tmp_path / "creds")
        conf = tmp_path / "n.conf"          # its port: natsserver's (-p -1, read back)
        conf.write_text(f"include \"creds/auth.conf\"\n"
                        f"jetstream {{ store_dir: \"{tmp_path / 'js'}\" }}\n")
        self.proc, self.port = natsserver.start("-c", str(conf))
        self.violations: list[str] = []

    async def connect(self, user: str):
        import asyncio

        import nats

        async def on_error(e) -> None:
            if "ermission" in str(e):
                self.violations.append(f"{user}: {e}")
        for _ in range(100):
            try:
                return await nats.connect(f"nats://127.0.0.1:{self.port}", error_cb=on_error,
                                          **self.secrets.auth(user).options(),
                                          connect_timeout=1, allow_reconnect=False)
            except Exception:  # noqa: BLE001 - server starting
                await asyncio.sleep(0.1)
        raise RuntimeError("nats-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
