"""A trigger's connection lookup: Airflow answers "isn't defined" for a lookup that failed as for a missing
conn_id, so a trigger looks again for a while before its wait fails; a worker's check does not wait."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog.testing
from airflow.sdk.exceptions import AirflowNotFoundException

from triggers.connections import aget_connection
from triggers.pg import target_for

LOOKING_AGAIN = "connection not found; looking it up again before failing the wait"


async def test_a_connection_found_after_failed_lookups_starts_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_LATE", raising=False)
    with structlog.testing.capture_logs() as logs:
        lookup = asyncio.create_task(target_for("late", patience=60))
        while not any(entry["event"] == LOOKING_AGAIN for entry in logs):  # it failed once: now it exists
            assert not lookup.done(), lookup
            await asyncio.sleep(0.01)
        monkeypatch.setenv("AIRFLOW_CONN_LATE", "postgresql://reader:s3cret@warehouse.example:6432/dw")
        target = await asyncio.wait_for(lookup, 30)
    assert (target.host, target.port, target.database) == ("warehouse.example", 6432, "dw")
    assert [entry["conn_id"] for entry in logs if entry["event"] == LOOKING_AGAIN] == ["late"]
    assert "s3cret" not in repr(logs)


async def test_a_connection_that_never_appears_fails_the_wait_with_airflows_message() -> None:
    started = time.monotonic()
    with pytest.raises(AirflowNotFoundException, match="The conn_id `nowhere` isn't defined"):
        await aget_connection("nowhere", patience=1.0)
    # it looked again until its patience ran out, not longer (the last sleep is cut to the deadline)
    assert 1.0 <= time.monotonic() - started < 5.0


async def test_waits_looking_up_one_connection_share_one_lookup() -> None:
    with structlog.testing.capture_logs() as logs:
        outcomes = await asyncio.gather(
            *(aget_connection("missing", patience=1.0) for _ in range(50)), return_exceptions=True
        )
    assert all(isinstance(o, AirflowNotFoundException) for o in outcomes), outcomes
    assert [entry["event"] for entry in logs].count(LOOKING_AGAIN) == 1  # one lookup loop, not fifty


async def test_a_wait_cancelled_while_looking_up_leaves_the_lookup_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_SHARED", raising=False)
    with structlog.testing.capture_logs() as logs:
        first = asyncio.create_task(aget_connection("shared", patience=60))
        second = asyncio.create_task(aget_connection("shared", patience=60))
        while not any(entry["event"] == LOOKING_AGAIN for entry in logs):
            await asyncio.sleep(0.01)
        first.cancel()
        monkeypatch.setenv("AIRFLOW_CONN_SHARED", "http://jobs.example:8080")
        conn = await asyncio.wait_for(second, 30)
    assert conn.host == "jobs.example"
    assert first.cancelled()


async def test_a_workers_check_does_not_wait() -> None:
    with pytest.raises(AirflowNotFoundException, match="nowhere"):
        await asyncio.wait_for(target_for("nowhere"), 10)
