"""The inbox's own checks, before any database work: signature headers that are not ASCII, secrets that
would make signatures forgeable, bodies read only up to the limit, and per-source asset allow-lists."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from dataset_bridge import signing
from dataset_bridge.inbox import (
    MAX_BODY,
    InboxBatch,
    InboxConfigError,
    Refused,
    authenticated_batch,
    forbidden,
    parse_allowed,
    parse_secrets,
    read_capped,
)

SECRETS = {"deployment_a": "s3cret-s3cret-s3cret"}


def _body(*uris: str) -> bytes:
    events = [
        {"id": n + 1, "uri": uri, "name": uri.rsplit("/", 1)[-1], "timestamp": "2026-01-01T00:00:00Z"}
        for n, uri in enumerate(uris)
    ]
    return json.dumps({"source": "deployment_a", "events": events}).encode()


def test_a_non_ascii_signature_is_a_401_not_a_crash() -> None:
    body = _body("warehouse://dds/h_user")
    headers = {k.lower(): v for k, v in signing.sign("deployment_a", SECRETS["deployment_a"], body).items()}
    headers["x-bridge-signature"] = "sha256=\u00e9" + "0" * 63
    with pytest.raises(Refused) as refused:
        authenticated_batch(SECRETS, headers, body)
    assert refused.value.status == 401


@pytest.mark.parametrize(
    "raw",
    [
        '{"deployment_a": ""}',
        '{"deployment_a": null}',
        '{"deployment_a": "  "}',
        '{"deployment_a": 5}',
        '["not", "an", "object"]',
        "{not json",
    ],
)
def test_secrets_that_would_make_signatures_forgeable_are_refused(raw: str) -> None:
    with pytest.raises(InboxConfigError, match="inbox_secrets"):
        parse_secrets(raw)
    # and even if such a secret reached the check, it would authenticate nothing
    body = b"{}"
    headers = {k.lower(): v for k, v in signing.sign("deployment_a", "", body).items()}
    with pytest.raises(signing.SignatureError):
        signing.verify({"deployment_a": ""}, headers, body)


async def test_a_chunked_body_is_abandoned_as_soon_as_it_passes_the_limit() -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += 64 * 1024
            yield b"x" * (64 * 1024)

    with pytest.raises(Refused) as refused:
        await read_capped(endless())
    assert refused.value.status == 413
    assert sent <= MAX_BODY + 64 * 1024  # never more than one chunk past the limit


async def test_a_body_within_the_limit_is_read_whole() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for part in (b'{"a"', b": 1}"):
            yield part

    assert await read_capped(chunks()) == b'{"a": 1}'


def test_each_source_may_use_only_its_allowed_assets() -> None:
    allowed = parse_allowed('{"deployment_a": ["warehouse://dds/h_user", "orders"]}', SECRETS)
    batch = InboxBatch.model_validate_json(
        _body("warehouse://dds/h_user", "warehouse://dds/orders", "warehouse://dds/payroll")
    )
    assert forbidden(batch, allowed["deployment_a"]) == ["warehouse://dds/payroll"]  # orders: by name
    assert forbidden(batch, frozenset({"*"})) == []
    assert forbidden(batch, allowed.get("deployment_unlisted", frozenset())) == [
        "warehouse://dds/h_user",
        "warehouse://dds/orders",
        "warehouse://dds/payroll",
    ]
    with pytest.raises(InboxConfigError, match="inbox_allowed_assets"):
        parse_allowed('{"deployment_a": "warehouse://dds/h_user"}', SECRETS)


def test_an_allow_list_entry_says_whether_it_is_a_uri_or_a_name() -> None:
    """``uri:`` matches an asset's URI only, ``name:`` its name only: an asset named like another asset's
    URI cannot be reached through it. A bare entry (the first releases' form) matches both, with a
    warning."""
    from structlog.testing import capture_logs

    allowed = parse_allowed('{"deployment_a": ["uri:warehouse://dds/h_user", "name:orders"]}', SECRETS)
    events = [
        {"id": 1, "uri": "warehouse://dds/h_user", "name": "something else"},
        {"id": 2, "uri": "warehouse://dds/x", "name": "orders"},
        {"id": 3, "uri": "orders", "name": "x"},  # a URI equal to an allowed name
        {"id": 4, "uri": "warehouse://dds/y", "name": "warehouse://dds/h_user"},
    ]  # and the reverse
    batch = InboxBatch.model_validate(
        {
            "source": "deployment_a",
            "events": [{**event, "timestamp": "2026-01-01T00:00:00Z"} for event in events],
        }
    )
    assert forbidden(batch, allowed["deployment_a"]) == ["orders", "warehouse://dds/y"]
    with capture_logs() as logs:
        legacy = parse_allowed('{"deployment_a": ["orders"]}', SECRETS)
    assert legacy["deployment_a"] == {"uri:orders", "name:orders"}
    assert any("without uri: or name:" in entry["event"] for entry in logs), logs
    with pytest.raises(InboxConfigError, match="empty entry 'name:'"):
        parse_allowed('{"deployment_a": ["name:"]}', SECRETS)


def _refusal(source: str, secret: str, age: float = 0.0) -> str:
    body = _body("warehouse://dds/h_user")
    signed = signing.sign(source, secret, body, now=time.time() - age)
    with pytest.raises(Refused) as refused:
        authenticated_batch(SECRETS, {k.lower(): v for k, v in signed.items()}, body)
    assert refused.value.status == 401
    return refused.value.detail


def test_a_401_does_not_tell_which_sources_exist() -> None:
    unknown = _refusal("deployment_x", "s3cret-s3cret-s3cret")
    assert unknown == _refusal("deployment_a", "a wrong secret")
    assert "deployment_x" not in unknown
    # a stale timestamp is refused the same way whether or not the source exists
    assert _refusal("deployment_x", "anything", age=3600) == _refusal(
        "deployment_a", SECRETS["deployment_a"], age=3600
    )


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (
            lambda: OperationalError(
                "INSERT ...", {"extra": "hunter2"}, Exception("server closed the connection")
            ),
            503,
        ),
        (lambda: KeyError("hunter2"), 500),
    ],
)
def test_a_database_b_cannot_reach_is_a_503_and_anything_else_a_500_naming_the_error_only(
    monkeypatch: pytest.MonkeyPatch, failure: Callable[[], Exception], status: int
) -> None:
    """The relay retries a 503 without end (an outage of B) and dead-letters an event whose batch keeps
    failing with a 500 (a bug in B): the answer names the error, never the values it may carry."""
    from fastapi.testclient import TestClient

    from dataset_bridge import inbox

    def receive(*args: Any) -> Any:
        raise failure()

    monkeypatch.setattr(inbox, "_settings", lambda: (SECRETS, {"deployment_a": frozenset({"*"})}))
    monkeypatch.setattr(inbox, "receive", receive)
    body = _body("warehouse://dds/h_user")
    headers = signing.sign("deployment_a", SECRETS["deployment_a"], body)
    answer = TestClient(inbox.app).post("/inbox", content=body, headers=headers)
    assert answer.status_code == status
    assert "hunter2" not in answer.text
    if status == 500:
        assert "KeyError" in answer.json()["detail"]
