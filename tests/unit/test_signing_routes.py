"""HMAC signing with a timestamp window, and the routes file's errors."""

from __future__ import annotations

import pytest

from dataset_bridge import signing
from dataset_bridge.routes import Routes, RoutesError

SECRETS = {"deployment_a": "s3cret"}


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def test_a_signed_body_verifies_and_names_its_source() -> None:
    headers = signing.sign("deployment_a", "s3cret", b'{"x": 1}', now=1000)
    assert signing.verify(SECRETS, _lower(headers), b'{"x": 1}', now=1010) == "deployment_a"


@pytest.mark.parametrize(
    ("source", "secret", "body", "now", "reason"),
    [
        ("deployment_a", "wrong", b"{}", 1000, "bad signature"),
        ("deployment_a", "s3cret", b"{tampered}", 1000, "bad signature"),
        ("deployment_x", "s3cret", b"{}", 1000, "unknown source"),
        ("deployment_a", "s3cret", b"{}", 1000 + 301, "window"),
    ],
)
def test_anything_else_is_refused_with_the_reason(
    source: str, secret: str, body: bytes, now: float, reason: str
) -> None:
    headers = signing.sign(source, secret, b"{}", now=1000)
    with pytest.raises(signing.SignatureError, match=reason):
        signing.verify(SECRETS, _lower(headers), body, now=now)


def test_missing_headers_are_refused() -> None:
    with pytest.raises(signing.SignatureError, match="missing"):
        signing.verify(SECRETS, {}, b"{}")


def test_routes_select_targets_by_uri_or_name() -> None:
    routes = Routes.parse(
        {
            "source": "a",
            "targets": {
                "b": {"url": "https://b/inbox", "secret_env": "B", "assets": ["warehouse://x", "users"]},
                "c": {
                    "url": "http://c/inbox",
                    "secret_env": "C",
                    "assets": ["warehouse://y"],
                    "max_attempts": 3,
                },
            },
        }
    )
    assert [t.name for t in routes.targets_for("warehouse://x", "x")] == ["b"]
    assert [t.name for t in routes.targets_for("other://z", "users")] == ["b"]
    assert routes.targets[1].max_attempts == 3 and routes.targets[1].assets == ("warehouse://y",)
    assert routes.targets[0].max_server_errors == 10  # the default


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"targets": {}}, "source must be a name"),
        ({"source": "a", "targets": {}}, "targets must map"),
        (
            {"source": "a", "targets": {"b": {"url": "ftp://b", "secret_env": "B", "assets": ["x"]}}},
            "url must be",
        ),
        ({"source": "a", "targets": {"b": {"url": "http://b", "assets": ["x"]}}}, "secret_env must name"),
        (
            {"source": "a", "targets": {"b": {"url": "http://b", "secret_env": "B", "assets": []}}},
            "assets must be",
        ),
        (
            {"source": "a", "targets": {"b": {"url": "http://b", "secret_env": "B", "assets": "x, y"}}},
            r"assets must be a non-empty list .*\(write \['x, y'\]\)",
        ),
        (
            {
                "source": "a",
                "targets": {"b": {"url": "http://b", "secret_env": "B", "assets": ["x"], "max_attempts": 0}},
            },
            "max_attempts",
        ),
        (
            {
                "source": "a",
                "targets": {
                    "b": {"url": "http://b", "secret_env": "B", "assets": ["x"], "max_server_errors": "5"}
                },
            },
            "max_server_errors must be a positive",
        ),
        (
            {
                "source": "a",
                "targets": {
                    "b": {"url": "http://b", "secret_env": "B", "assets": ["x"], "max_server_errors": True}
                },
            },
            "max_server_errors must be a positive",
        ),
    ],
)
def test_routes_errors_name_the_entry(raw: object, message: str) -> None:
    with pytest.raises(RoutesError, match=message):
        Routes.parse(raw, source_file="routes.yaml")


def test_a_missing_secret_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BRIDGE_SECRET_NOPE", raising=False)
    routes = Routes.parse(
        {
            "source": "a",
            "targets": {"b": {"url": "http://b", "secret_env": "BRIDGE_SECRET_NOPE", "assets": ["x"]}},
        }
    )
    with pytest.raises(RoutesError, match="BRIDGE_SECRET_NOPE"):
        routes.targets[0].secret()
