"""Shared-secret HMAC for relay -> inbox requests, with a timestamp window against replays of old requests.

Signature: ``sha256=`` + hex HMAC-SHA256 of ``"<unix timestamp>." + body`` with the source's secret, sent in
``X-Bridge-Signature`` with ``X-Bridge-Source`` and ``X-Bridge-Timestamp``. A replay inside the window is
harmless: the inbox is idempotent by (source, event id).
"""

from __future__ import annotations

import hashlib
import hmac
import time

WINDOW_SECONDS = 300
SOURCE_HEADER = "X-Bridge-Source"
TIMESTAMP_HEADER = "X-Bridge-Timestamp"
SIGNATURE_HEADER = "X-Bridge-Signature"


# The same answer for a source the receiver does not know and a signature that does not match: a caller
# must not learn which source names exist.
NOT_AUTHENTIC = "unknown source or bad signature (is the source's secret the same on both sides?)"
# the HMAC key for an unknown source, so that its refusal costs the time a known one's does
_DECOY = "dataset-bridge: no such source"


# what a refusal's ``reason`` says (the inbox's 401 answer carries it): a sender whose clock is off is
# retried and reported, a refusal counts toward its bound
CLOCK_SKEW = "clock_skew"
NOT_AUTHENTICATED = "not_authenticated"


class SignatureError(Exception):
    """The request is not authentic (the message says why, never what the secret is, nor whether the
    source named exists); ``reason`` is ``CLOCK_SKEW`` or ``NOT_AUTHENTICATED``."""

    def __init__(self, message: str, reason: str = NOT_AUTHENTICATED) -> None:
        super().__init__(message)
        self.reason = reason


def signature(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def sign(source: str, secret: str, body: bytes, now: float | None = None) -> dict[str, str]:
    timestamp = str(int(now if now is not None else time.time()))
    return {
        SOURCE_HEADER: source,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(secret, timestamp, body),
    }


def check_headers(headers: dict[str, str], now: float | None = None) -> tuple[str, str, str]:
    """(source, timestamp, signature) when the headers are there and the timestamp is within the window;
    SignatureError otherwise. Needs neither the body nor a secret: checked before the body is read."""
    source = headers.get(SOURCE_HEADER.lower(), "")
    timestamp = headers.get(TIMESTAMP_HEADER.lower(), "")
    given = headers.get(SIGNATURE_HEADER.lower(), "")
    if not source or not timestamp or not given:
        raise SignatureError(f"missing {SOURCE_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}")
    try:
        offset = (now if now is not None else time.time()) - int(timestamp)
    except ValueError as err:
        raise SignatureError("the timestamp is not a unix time") from err
    if abs(offset) > WINDOW_SECONDS:
        side = "behind" if offset > 0 else "ahead of"
        raise SignatureError(
            f"the sender's clock is {abs(offset):.0f}s {side} the receiver's (window "
            f"{WINDOW_SECONDS}s): synchronise the clocks (NTP)",
            CLOCK_SKEW,
        )
    return source, timestamp, given


def verify(secrets: dict[str, str], headers: dict[str, str], body: bytes, now: float | None = None) -> str:
    """The authenticated source name; SignatureError otherwise. Whatever does not depend on the source
    (headers, timestamp) is checked first, and an unknown source fails as a bad signature does."""
    source, timestamp, given = check_headers(headers, now)
    secret = secrets.get(source) or ""  # an empty secret would accept an HMAC anyone can compute
    expected = signature(secret or _DECOY, timestamp, body)
    if not secret or not given.isascii() or not hmac.compare_digest(given, expected):
        raise SignatureError(NOT_AUTHENTIC)
    return source
