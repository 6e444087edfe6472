"""The relay's HTTP client against a real aiohttp inbox over TLS: a target's own CA is trusted through
``ca_file``; without it the certificate is refused (and the batch is not delivered)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dataset_bridge import signing
from dataset_bridge.relay import DeliveryError, Relay, RelaySettings
from dataset_bridge.routes import Routes
from devkit.pgserver import free_port


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


@pytest.fixture
async def tls_inbox(tmp_path: Path) -> AsyncIterator[tuple[str, Path, list[Any]]]:
    cert, key = _self_signed(tmp_path)
    received: list[Any] = []

    async def inbox(request: web.Request) -> web.Response:
        body = await request.read()
        signing.verify({"deployment_a": "s3cret"}, {k.lower(): v for k, v in request.headers.items()}, body)
        batch = json.loads(body)
        received.extend(batch["events"])
        return web.json_response({"results": [{"id": e["id"], "status": "created"} for e in batch["events"]]})

    app = web.Application()
    app.router.add_post("/dataset-bridge/inbox", inbox)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield f"https://127.0.0.1:{port}/dataset-bridge/inbox", cert, received
    finally:
        await runner.cleanup()


def _routes(url: str, ca_file: Path | None) -> Routes:
    target: dict[str, Any] = {"url": url, "secret_env": "BRIDGE_SECRET_TLS", "assets": ["x"]}
    if ca_file:
        target["ca_file"] = str(ca_file)
    return Routes.parse({"source": "deployment_a", "targets": {"b": target}})


async def test_tls_with_the_targets_ca_delivers_and_without_it_refuses(
    tls_inbox: tuple[str, Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, cert, received = tls_inbox
    monkeypatch.setenv("BRIDGE_SECRET_TLS", "s3cret")
    body = json.dumps({"source": "deployment_a", "events": [{"id": 7}]}).encode()
    async with aiohttp.ClientSession() as session:
        trusted = _routes(url, cert)
        relay = Relay(None, trusted, RelaySettings())  # type: ignore[arg-type]
        assert await relay._post(session, trusted.targets[0], body) == [{"id": 7, "status": "created"}]
        untrusted = _routes(url, None)
        with pytest.raises(DeliveryError, match="certificate"):
            await Relay(None, untrusted, RelaySettings())._post(  # type: ignore[arg-type]
                session, untrusted.targets[0], body
            )
    assert received == [{"id": 7}]
