"""How a process reaches NATS (shared/natsconn.py): server lists, identity from the
environment or the URL, TLS; and the settings every service has for it."""
from __future__ import annotations

import pytest

from pdmesh.local.cluster import CONFIG_CLASSES, config_class
from shared.natsconn import NatsAuth, connect_kwargs, servers
from shared.settings import field_names, load


def test_server_lists():
    assert servers("nats://a:1") == ["nats://a:1"]
    assert servers(" nats://a:1, nats://b:2 ,") == ["nats://a:1", "nats://b:2"]
    with pytest.raises(ValueError):
        servers(" , ")


def test_identity_from_env_and_url(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    auth = NatsAuth.from_env({"PDMESH_NATS_USER": "decode",
                              "PDMESH_NATS_PASSWORD_FILE": str(pw)})
    kw = connect_kwargs("nats://a:1,nats://b:2", auth)
    assert kw == {"servers": ["nats://a:1", "nats://b:2"], "user": "decode",
                  "password": "s3cret", "inbox_prefix": "_INBOX.decode"}
    assert connect_kwargs("nats://debug:x@a:1")["inbox_prefix"] == "_INBOX.debug"
    assert connect_kwargs("nats://a:1") == {"servers": ["nats://a:1"]}     # no auth: as before


def test_tls_ca_makes_every_url_tls(tmp_path):
    from pdmesh.deploy.creds import make_tls

    tls = make_tls(tmp_path, ["127.0.0.1"])
    kw = connect_kwargs("nats://a:1,tls://b:2", NatsAuth(tls_ca=str(tls.ca)))
    assert kw["servers"] == ["tls://a:1", "tls://b:2"] and kw["tls"].check_hostname


@pytest.mark.parametrize("service", sorted(CONFIG_CLASSES))
def test_every_service_takes_its_nats_identity(service, monkeypatch):
    cls = config_class(service)
    assert {"nats_user", "nats_password", "nats_password_file", "nats_tls_ca"} <= field_names(cls)
    monkeypatch.setenv("PDMESH_NATS_USER", service)
    monkeypatch.setenv("PDMESH_MODEL", "m")
    cfg = load(cls, argv=["--nats-tls-ca", "/ca.pem"])
    assert cfg.nats == NatsAuth(user=service, tls_ca="/ca.pem")


async def test_a_cancelled_flush_does_not_stop_the_connection_reading(tmp_path, caplog):
    """A flush() cancelled before its PONG (a timeout around micro.collect, a shutdown) left
    nats-py's read loop dead: the PONG raised InvalidStateError there and nothing was read
    again, so the request after it timed out. Every connection made with connect_kwargs
    takes the fix (shared/pongs.py)."""
    import asyncio
    import logging

    import nats

    from tests import natsserver

    server, port = natsserver.start()
    try:
        kw = connect_kwargs(f"nats://127.0.0.1:{port}")
        for _ in range(50):
            try:
                nc, echo = await nats.connect(**kw), await nats.connect(**kw)
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                await asyncio.sleep(0.1)

        async def answer(msg):
            await msg.respond(msg.data)
        await echo.subscribe("echo", cb=answer)
        await echo.flush()
        caplog.set_level(logging.ERROR, logger="nats.aio.client")
        seen = len(caplog.records)             # (connecting while the server started logs)
        for _ in range(3):
            flush = asyncio.create_task(nc.flush())
            await asyncio.sleep(0)                 # its PING is sent; the PONG is on its way
            flush.cancel()
        reply = await nc.request("echo", b"still reading", timeout=3)
        assert reply.data == b"still reading"
        assert not [r for r in caplog.records[seen:] if r.name == "nats.aio.client"]
        await nc.close()
        await echo.close()
    finally:
        server.terminate()
        server.wait(10)


async def test_a_flush_reaches_the_server_after_what_was_sent_before_it():
    """subscribe() then flush(): the server must read the SUB before the flush's PING, or
    its PONG can come back before the subscription exists (a request right after it then
    got "no responders" on a loaded machine). The bytes the client writes, in order."""
    import nats

    from tests import natsserver

    server, port = natsserver.start()
    try:
        nc = await nats.connect(**connect_kwargs(f"nats://127.0.0.1:{port}"))
        written: list[bytes] = []
        transport = nc._transport
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: (written.append(bytes(data)), write(data))[1]
        transport.writelines = lambda items: (written.extend(bytes(b) for b in items),
                                              writelines(items))[1]
        await nc.subscribe("ordered")
        await nc.flush()
        await nc.close()
    finally:
        server.terminate()
        server.wait(10)
    stream = b"".join(written)
    assert b"SUB ordered" in stream and b"PING\r\n" in stream
    assert stream.index(b"SUB ordered") < stream.index(b"PING\r\n"), written
