"""Deployment B's inbox: an authenticated endpoint in B's api-server that turns relayed events into asset
events, idempotent by (source deployment, source event id).

Served by B's own api-server as an Airflow plugin (``POST /dataset-bridge/inbox``; TLS as the api-server
is configured, e.g. ``--ssl-cert/--ssl-key``). Inert until ``[dataset_bridge] inbox_secrets`` (JSON:
source name -> shared secret; env ``AIRFLOW__DATASET_BRIDGE__INBOX_SECRETS``) is set: then every request
must carry a valid HMAC signature from a known source within the timestamp window (``signing.py``).

Answers: 401 bad or missing signature, 413 body over 1 MiB, 400 not JSON, 422 not the expected shape; else
200 with one result per event: ``created``, ``duplicate`` (this source's event id was received before:
nothing is created) or ``unknown_asset`` (no asset with that URI or name in B; the relay dead-letters it).
Each event is resolved by URI first, then by name, and created through Airflow's asset manager together
with its inbox row, in one transaction.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import structlog
from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from dataset_bridge import ddl, signing

log = structlog.get_logger(__name__)

MAX_BODY = 1024 * 1024
MAX_EVENTS = 1000
SCHEMA_DDL = """
CREATE SCHEMA IF NOT EXISTS dataset_bridge;
CREATE TABLE IF NOT EXISTS dataset_bridge.inbox (
    source text NOT NULL,
    source_event_id bigint NOT NULL,
    asset_event_id integer,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, source_event_id)
)
"""
CLAIM = """
INSERT INTO dataset_bridge.inbox (source, source_event_id) VALUES (:source, :id)
ON CONFLICT DO NOTHING RETURNING source
"""


class InboxEvent(BaseModel):
    id: int = Field(ge=1)
    uri: str = Field(min_length=1, max_length=1500)
    name: str = Field(min_length=1, max_length=1500)
    extra: dict[str, Any] = Field(default_factory=dict)
    timestamp: dt.datetime


class InboxBatch(BaseModel):
    source: str = Field(min_length=1, max_length=100)
    events: list[InboxEvent] = Field(min_length=1, max_length=MAX_EVENTS)


def _secrets() -> dict[str, str]:
    from airflow.configuration import conf

    raw = conf.get("dataset_bridge", "inbox_secrets", fallback="") or ""
    if not raw:
        return {}
    parsed = json.loads(raw)
    return {str(k): str(v) for k, v in parsed.items()} if isinstance(parsed, dict) else {}


_schema_ready = False


def _ensure_schema(session: Any) -> None:
    global _schema_ready  # noqa: PLW0603 (once per process)
    if _schema_ready:
        return
    ddl.apply(session, SCHEMA_DDL)
    _schema_ready = True


def _resolve(session: Any, uri: str, name: str) -> Any:
    from airflow.models.asset import AssetActive, AssetModel
    from sqlalchemy import select

    active = select(AssetModel).join(
        AssetActive, (AssetActive.name == AssetModel.name) & (AssetActive.uri == AssetModel.uri))
    return (session.scalars(active.where(AssetModel.uri == uri)).first()
            or session.scalars(active.where(AssetModel.name == name)).first())


def receive(batch: InboxBatch) -> list[dict[str, Any]]:
    """Create the batch's new events in one transaction; one result per event."""
    from airflow.assets.manager import asset_manager
    from airflow.utils.session import create_session
    from sqlalchemy import text

    results: list[dict[str, Any]] = []
    with create_session() as session:
        _ensure_schema(session)
        for event in batch.events:
            asset = _resolve(session, event.uri, event.name)
            if asset is None:
                results.append({"id": event.id, "status": "unknown_asset",
                                "error": f"no active asset with uri {event.uri!r} or name {event.name!r}"})
                continue
            if session.execute(text(CLAIM), {"source": batch.source, "id": event.id}).first() is None:
                results.append({"id": event.id, "status": "duplicate"})
                continue
            extra = {"idempotency_key": f"{batch.source}/{event.id}", "source_deployment": batch.source,
                     "source_event_id": event.id, "source_timestamp": event.timestamp.isoformat(),
                     "source_extra": event.extra}
            created = asset_manager.register_asset_change(asset=asset.to_serialized(), extra=extra,
                                                          session=session)
            session.execute(text("UPDATE dataset_bridge.inbox SET asset_event_id = :e "
                                 "WHERE source = :s AND source_event_id = :i"),
                            {"e": created.id if created else None, "s": batch.source, "i": event.id})
            results.append({"id": event.id, "status": "created"})
    return results


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


app = FastAPI(title="dataset bridge inbox")


class Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def authenticated_batch(secrets: dict[str, str], headers: dict[str, str], body: bytes) -> InboxBatch:
    """The request's batch, or Refused with the status and a message that says what is wrong."""
    if len(body) > MAX_BODY:
        raise Refused(413, f"body over {MAX_BODY} bytes")
    try:
        source = signing.verify(secrets, headers, body)
    except signing.SignatureError as err:
        log.warning("inbox request rejected", reason=str(err))
        raise Refused(401, f"not authenticated: {err}") from err
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
    secrets = _secrets()
    if not secrets:
        return _error(503, "the inbox is not configured ([dataset_bridge] inbox_secrets)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        return _error(413, f"body over {MAX_BODY} bytes")  # before reading it
    try:
        batch = authenticated_batch(secrets, {k.lower(): v for k, v in request.headers.items()},
                                    await request.body())
    except Refused as err:
        return _error(err.status, err.detail)
    results = await run_in_threadpool(receive, batch)
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
