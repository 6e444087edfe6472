"""Deployment B's inbox: an authenticated endpoint in B's api-server that turns relayed events into asset
events, idempotent by (source deployment, source event id).

Served by B's own api-server as an Airflow plugin (``POST /dataset-bridge/inbox``; TLS as the api-server
is configured, e.g. ``--ssl-cert/--ssl-key``). Inert until ``[dataset_bridge] inbox_secrets`` (JSON:
source name -> shared secret; env ``AIRFLOW__DATASET_BRIDGE__INBOX_SECRETS``) is set: then every request
must carry a valid HMAC signature from a known source within the timestamp window (``signing.py``).

Each source may create events only for the assets ``[dataset_bridge] inbox_allowed_assets`` lists for it
(JSON: source -> ``["uri:<asset URI>", "name:<asset name>", ...]``, ``"*"`` for any); a source not listed
may create none. An entry says which identifier it is: an asset named like another asset's URI cannot be
reached through it. An entry without ``uri:`` or ``name:`` (the first releases' form) stands for both, and
the inbox warns about it.

Answers: 401 bad or missing signature (the same answer for a source B does not know, so that no caller
learns which sources exist; ``reason`` says ``not_authenticated``, or ``clock_skew`` when the timestamp is
out of the window, which the headers tell before the body is read), 413 body over 1 MiB (checked while
reading, also for chunked bodies), 503 with ``Retry-After`` while ``MAX_UNREAD_BODIES`` bodies are being
read (a caller anyone can be holds at most that many), 408 for a body slower than ``BODY_READ_SECONDS``,
400 not JSON, 422 not the expected shape, 503 not or mis-configured (an empty secret is refused: it would
make signatures forgeable); else 200 with one result per event: ``created``, ``duplicate`` (this
source's event id was received before: nothing is created), ``forbidden`` (the source may not use that
asset) or ``unknown_asset`` (no asset with that URI or name in B). The relay dead-letters a ``forbidden``
or ``unknown_asset`` event alone, with the reason; the rest of its batch is delivered.
Each event is resolved by URI first, then by name, and created through Airflow's asset manager together
with its inbox row, in one transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from dataset_bridge import signing, store

log = structlog.get_logger(__name__)

MAX_BODY = 1024 * 1024
# bodies read at once before their signature is checked (per api-server process): a caller anyone can be
# holds at most this many MiB; past it a request is answered 503 (the relay retries) without being read
MAX_UNREAD_BODIES = 8
BODY_READ_SECONDS = 30  # a body trickled in slower than this is answered 408 and its slot freed
MAX_EVENTS = 1000


class InboxEvent(BaseModel):
    id: int = Field(ge=1)
    uri: str = Field(min_length=1, max_length=1500)
    name: str = Field(min_length=1, max_length=1500)
    extra: dict[str, Any] = Field(default_factory=dict)
    timestamp: dt.datetime


class InboxBatch(BaseModel):
    source: str = Field(min_length=1, max_length=100)
    events: list[InboxEvent] = Field(min_length=1, max_length=MAX_EVENTS)


class InboxConfigError(ValueError):
    """``[dataset_bridge]`` inbox settings that must not be served; the message names the setting."""


def parse_secrets(raw: str) -> dict[str, str]:
    """``inbox_secrets``: source -> non-empty secret. An empty or null secret would make every signature
    forgeable, so such a configuration is refused as a whole."""
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as err:
        raise InboxConfigError(f"[dataset_bridge] inbox_secrets is not JSON: {err.msg}") from None
    if not isinstance(parsed, dict):
        raise InboxConfigError("[dataset_bridge] inbox_secrets must be a JSON object: source -> secret")
    for source, secret in parsed.items():
        if not isinstance(secret, str) or not secret.strip():
            raise InboxConfigError(
                f"[dataset_bridge] inbox_secrets: source {source!r} has an empty or "
                "non-string secret; refusing to serve the inbox"
            )
    return {str(k): str(v) for k, v in parsed.items()}


ALLOWED_KINDS = ("uri:", "name:")
_warned_bare: set[tuple[str, tuple[str, ...]]] = set()


def allowed_entries(source: str, assets: list[str]) -> frozenset[str]:
    """One source's allow-list as ``uri:...``/``name:...`` entries (and ``*``); a bare entry stands for
    both, with a warning."""
    entries: set[str] = set()
    bare = [a for a in assets if a != "*" and not a.startswith(ALLOWED_KINDS)]
    if bare and (source, tuple(bare)) not in _warned_bare:  # read per request: said once per process
        _warned_bare.add((source, tuple(bare)))
        log.warning(
            "inbox_allowed_assets entries without uri: or name: match an asset's URI or its name; "
            "write uri:<URI> or name:<name>",
            source=source,
            entries=bare[:10],
        )
    for entry in assets:
        if entry.startswith(ALLOWED_KINDS) and not entry.split(":", 1)[1]:
            raise InboxConfigError(
                f"[dataset_bridge] inbox_allowed_assets: source {source!r} has an empty entry {entry!r}"
            )
        entries.update((f"uri:{entry}", f"name:{entry}") if entry in bare else (entry,))
    return frozenset(entries)


def parse_allowed(raw: str, sources: dict[str, str]) -> dict[str, frozenset[str]]:
    """``inbox_allowed_assets``: source -> the assets it may create events for, each ``uri:<URI>`` or
    ``name:<name>`` (``"*"``: any). A source not listed may create none."""
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as err:
        raise InboxConfigError(f"[dataset_bridge] inbox_allowed_assets is not JSON: {err.msg}") from None
    if not isinstance(parsed, dict):
        raise InboxConfigError(
            "[dataset_bridge] inbox_allowed_assets must be a JSON object: "
            'source -> ["uri:<asset URI>", "name:<asset name>", ...]'
        )
    allowed: dict[str, frozenset[str]] = {}
    for source, assets in parsed.items():
        if not isinstance(assets, list) or not all(isinstance(a, str) and a for a in assets):
            raise InboxConfigError(
                f"[dataset_bridge] inbox_allowed_assets: source {source!r} must map to a "
                'list of "uri:<asset URI>" / "name:<asset name>" entries'
            )
        if source not in sources:
            log.warning("inbox_allowed_assets names a source with no secret", source=source)
        allowed[str(source)] = allowed_entries(str(source), assets)
    return allowed


def _settings() -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    from airflow.configuration import conf

    secrets = parse_secrets(conf.get("dataset_bridge", "inbox_secrets", fallback="") or "")
    allowed = parse_allowed(conf.get("dataset_bridge", "inbox_allowed_assets", fallback="") or "", secrets)
    return secrets, allowed


def _secrets() -> dict[str, str]:
    return _settings()[0]


def may_use_uri(allowed: frozenset[str], uri: str) -> bool:
    return "*" in allowed or f"uri:{uri}" in allowed


def may_use_name(allowed: frozenset[str], name: str) -> bool:
    return "*" in allowed or f"name:{name}" in allowed


def may_use(allowed: frozenset[str], event: InboxEvent) -> bool:
    return may_use_uri(allowed, event.uri) or may_use_name(allowed, event.name)


# databases (by URL) where this process created or found the inbox table: checked once per database
_schema_ready: set[str] = set()


def _ensure_schema(session: Any) -> None:
    database = session.connection().engine.url.render_as_string(hide_password=True)
    if database in _schema_ready:
        return
    store.migrate(session)
    _schema_ready.add(database)


def _resolve(session: Any, uri: str | None, name: str | None) -> Any:
    from airflow.models.asset import AssetActive, AssetModel
    from sqlalchemy import select

    active = select(AssetModel).join(
        AssetActive, (AssetActive.name == AssetModel.name) & (AssetActive.uri == AssetModel.uri)
    )
    return (
        (uri is not None and session.scalars(active.where(AssetModel.uri == uri)).first())
        or (name is not None and session.scalars(active.where(AssetModel.name == name)).first())
        or None
    )


def forbidden(batch: InboxBatch, allowed: frozenset[str]) -> list[str]:
    """The events' asset references this source may not use (neither its URI nor its name is allowed)."""
    return sorted({event.uri for event in batch.events if not may_use(allowed, event)})


CLAIM_MANY = """
INSERT INTO dataset_bridge.inbox (source, source_event_id)
SELECT :source, unnest(CAST(:ids AS bigint[]))
ON CONFLICT DO NOTHING RETURNING source_event_id
"""
LINK_MANY = """
UPDATE dataset_bridge.inbox i SET asset_event_id = x.event_id
FROM unnest(CAST(:ids AS bigint[]), CAST(:events AS integer[])) AS x(source_event_id, event_id)
WHERE i.source = :source AND i.source_event_id = x.source_event_id
"""


def receive(batch: InboxBatch, allowed: frozenset[str] = frozenset({"*"})) -> list[dict[str, Any]]:
    """Create the batch's new events in one transaction, in batch order; one result per event. An event
    resolves only through an identifier (URI, then name) the source is allowed to use."""
    from airflow.utils.session import create_session
    from sqlalchemy import text

    from dataset_bridge.bulk_events import create_events

    with create_session() as session:
        _ensure_schema(session)
        assets: dict[tuple[str, str], Any] = {}
        for event in batch.events:
            if (event.uri, event.name) not in assets:
                assets[event.uri, event.name] = _resolve(
                    session,
                    event.uri if may_use_uri(allowed, event.uri) else None,
                    event.name if may_use_name(allowed, event.name) else None,
                )
        denied = {e.id for e in batch.events if not may_use(allowed, e)}
        known = [e.id for e in batch.events if assets[e.uri, e.name] is not None and e.id not in denied]
        claimed = set(session.execute(text(CLAIM_MANY), {"source": batch.source, "ids": known}).scalars())
        results, to_create = _outcomes(batch, assets, claimed, denied)
        by_asset: dict[int, list[InboxEvent]] = {}
        for event in to_create:
            by_asset.setdefault(assets[event.uri, event.name].id, []).append(event)
        for events in by_asset.values():
            asset = assets[events[0].uri, events[0].name]
            ids = create_events(session, asset, [_extra(batch.source, e) for e in events])
            if len(ids) == len(events):  # (the asset was resolved just now: never fewer)
                session.execute(
                    text(LINK_MANY), {"source": batch.source, "ids": [e.id for e in events], "events": ids}
                )
    return results


def _outcomes(
    batch: InboxBatch, assets: dict[tuple[str, str], Any], claimed: set[int], denied: set[int]
) -> tuple[list[dict[str, Any]], list[InboxEvent]]:
    """One result per event (in order) and the events to create: the first of each claimed id."""
    results: list[dict[str, Any]] = []
    to_create: list[InboxEvent] = []
    for event in batch.events:
        if event.id in denied:
            results.append(
                {
                    "id": event.id,
                    "status": "forbidden",
                    "error": f"source {batch.source!r} may not create events for {event.uri!r} "
                    "(see [dataset_bridge] inbox_allowed_assets)",
                }
            )
        elif assets[event.uri, event.name] is None:
            results.append(
                {
                    "id": event.id,
                    "status": "unknown_asset",
                    "error": f"no active asset with uri {event.uri!r} or name {event.name!r}",
                }
            )
        elif event.id in claimed:
            claimed.discard(event.id)  # a second copy of the id in this batch is a duplicate
            to_create.append(event)
            results.append({"id": event.id, "status": "created"})
        else:
            results.append({"id": event.id, "status": "duplicate"})
    return results, to_create


def _extra(source: str, event: InboxEvent) -> dict[str, Any]:
    return {
        "idempotency_key": f"{source}/{event.id}",
        "source_deployment": source,
        "source_event_id": event.id,
        "source_timestamp": event.timestamp.isoformat(),
        "source_extra": event.extra,
    }


_last_prune = float("-inf")
PRUNE_EVERY = 600.0


def _prune_now_and_then() -> None:
    """Old inbox keys go every ten minutes or so (a relay redelivers within minutes, never after days)."""
    global _last_prune  # noqa: PLW0603 (once per process and interval)
    if time.monotonic() - _last_prune < PRUNE_EVERY:
        return
    _last_prune = time.monotonic()
    from airflow.configuration import conf
    from airflow.utils.session import create_session

    from dataset_bridge.retention import Retention, prune

    days = conf.getfloat("dataset_bridge", "inbox_retention_days", fallback=30.0)
    prune(create_session, ["dataset_bridge.inbox"], Retention(days=days))


def _error(status: int, detail: str, reason: str | None = None) -> JSONResponse:
    """The answer to a refused request; a 401 says whether it was the clock (``reason``)."""
    body: dict[str, Any] = {"detail": detail}
    if reason is not None:
        body["reason"] = reason
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _failure(source: str, err: Exception) -> JSONResponse:
    """503 when B's database cannot be reached or gave up on the transaction (the relay retries without
    end), else 500, which the relay counts toward the event's ``max_server_errors``. Neither answer nor
    log carries the error's message: it may quote the events' values."""
    from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    if isinstance(err, (OperationalError, DisconnectionError, PoolTimeout)) or (
        isinstance(err, DBAPIError) and err.connection_invalidated
    ):
        log.warning("inbox database unavailable; answered 503", source=source, error=type(err).__name__)
        return _error(503, "the inbox's database is unavailable; retry later")
    error_id = uuid.uuid4().hex[:12]
    cause = _where(err)
    log.error("inbox batch failed; answered 500", source=source, error=cause, error_id=error_id)
    return _error(500, f"the inbox failed on this batch: {cause} (error id {error_id} in B's api-server log)")


def _where(err: BaseException) -> str:
    """The error's type (with its SQLSTATE for a database error) and the line that raised it."""
    from sqlalchemy.exc import DBAPIError

    kind = type(err).__name__
    code = getattr(getattr(err, "orig", None), "pgcode", None) if isinstance(err, DBAPIError) else None
    frames = traceback.extract_tb(err.__traceback__)
    place = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{kind}{f' (SQLSTATE {code})' if code else ''}{place}"


app = FastAPI(title="dataset bridge inbox")


class Refused(Exception):
    def __init__(self, status: int, detail: str, reason: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.reason = status, detail, reason


class BodySlots:
    """Bodies being read now, in this process's event loop (at most ``MAX_UNREAD_BODIES``)."""

    reading = 0


async def read_bounded(request: Request) -> bytes:
    """The body, if a slot among ``MAX_UNREAD_BODIES`` is free and it comes within ``BODY_READ_SECONDS``."""
    if BodySlots.reading >= MAX_UNREAD_BODIES:
        raise Refused(503, f"busy: {MAX_UNREAD_BODIES} request bodies are being read; retry shortly")
    BodySlots.reading += 1
    try:
        async with asyncio.timeout(BODY_READ_SECONDS):
            return await read_capped(request.stream())
    except TimeoutError:
        raise Refused(408, f"the body did not arrive within {BODY_READ_SECONDS}s") from None
    finally:
        BodySlots.reading -= 1


async def read_capped(chunks: AsyncIterator[bytes], limit: int = MAX_BODY) -> bytes:
    """The body, read chunk by chunk and abandoned as soon as it passes ``limit`` (a chunked request
    declares no length: reading it whole before authenticating would let anyone fill the memory)."""
    body = bytearray()
    async for chunk in chunks:
        body.extend(chunk)
        if len(body) > limit:
            raise Refused(413, f"body over {limit} bytes")
    return bytes(body)


def _checked_headers(headers: dict[str, str]) -> None:
    """Headers and clock first: a request that can never pass is answered before its body is read."""
    try:
        signing.check_headers(headers)
    except signing.SignatureError as err:
        log.warning("inbox request rejected", reason=str(err))
        raise Refused(401, f"not authenticated: {err}", err.reason) from err


def authenticated_batch(secrets: dict[str, str], headers: dict[str, str], body: bytes) -> InboxBatch:
    """The request's batch, or Refused with the status and a message that says what is wrong."""
    if len(body) > MAX_BODY:
        raise Refused(413, f"body over {MAX_BODY} bytes")
    try:
        source = signing.verify(secrets, headers, body)
    except signing.SignatureError as err:
        # the log, for B's operators, says whether the claimed source is configured; the answer does not
        claimed = headers.get(signing.SOURCE_HEADER.lower(), "")[:100]
        log.warning(
            "inbox request rejected", reason=str(err), source=claimed, known_source=claimed in secrets
        )
        raise Refused(401, f"not authenticated: {err}", err.reason) from err
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Refused(400, f"body is not JSON: {err}") from err
    try:
        batch = InboxBatch.model_validate(raw)
    except ValidationError as err:
        problems = err.errors(include_url=False, include_input=False)
        raise Refused(422, f"not an event batch: {problems}") from err
    if batch.source != source:
        raise Refused(422, f"batch source {batch.source!r} is not the signing source {source!r}")
    return batch


@app.post("/inbox")
async def inbox(request: Request) -> JSONResponse:
    try:
        secrets, allowed = _settings()
    except InboxConfigError as err:
        log.error("inbox refuses to serve: misconfigured", error=str(err))
        return _error(503, f"the inbox is misconfigured: {err}")
    if not secrets:
        return _error(503, "the inbox is not configured ([dataset_bridge] inbox_secrets)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        return _error(413, f"body over {MAX_BODY} bytes")  # before reading it
    try:
        headers = {k.lower(): v for k, v in request.headers.items()}
        _checked_headers(headers)
        body = await read_bounded(request)
        batch = authenticated_batch(secrets, headers, body)
        refused = forbidden(batch, allowed.get(batch.source, frozenset()))
        if refused:
            # refused one by one (results): one asset missing from the allow-list must not hold back the
            # allowed events of its batch
            log.warning(
                "inbox events refused: assets not allowed for this source",
                source=batch.source,
                assets=refused[:10],
            )
    except Refused as err:
        return _error(err.status, err.detail, err.reason)
    try:
        results = await run_in_threadpool(receive, batch, allowed.get(batch.source, frozenset()))
    except Exception as err:
        return _failure(batch.source, err)
    await run_in_threadpool(_prune_now_and_then)
    created = sum(1 for r in results if r["status"] == "created")
    log.info("inbox batch received", source=batch.source, events=len(results), created=created)
    return JSONResponse({"results": results})


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"configured": bool(_secrets())}


class DatasetBridgeInboxPlugin(AirflowPlugin):
    """Mounts the inbox in the api-server (registered through the ``airflow.plugins`` entry point)."""

    name = "dataset_bridge_inbox"
    fastapi_apps = [{"app": app, "url_prefix": "/dataset-bridge", "name": "dataset bridge inbox"}]
