"""A remote log store that hangs never stalls the supervisor's loop, on real processes.

The instance is pointed at a remote log handler whose uploads block until the test releases them
(``tests.helpers.remote_logs``). Every ended coroutine's file is queued for upload; meanwhile the leases
must keep being renewed (by the database clock), no shard may lapse or move, every task resumes once, and
a graceful stop says in one line what it could not upload.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import AT_TIME, LEASE, in_seconds, metrics, seed

WAITS = 10


@pytest.fixture
def audited(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(airflow_stack.config.database_dsn, AUDIT_DDL + "; SELECT 1")
    yield airflow_stack


def lease_horizon(dsn: str) -> float:
    """How far ahead (database clock, epoch seconds) the least renewed live lease runs."""
    return float(
        rows(
            dsn,
            "SELECT extract(epoch FROM min(expires_at)) FROM smart_triggerer.shard_lease "
            "WHERE owner_job_id IS NOT NULL",
        )[0][0]
        or 0.0
    )


def test_a_hanging_remote_log_store_never_stalls_the_leases(audited: AirflowStack, tmp_path: Path) -> None:
    dsn = audited.config.database_dsn
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    seeded = seed(audited, WAITS, AT_TIME, lambda i: {"moment": in_seconds(15 + i % 5)})
    instance = audited.start_smart_triggerer(
        "smart-a",
        env={
            **_env(),
            "AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS": "tests.helpers.remote_logs.LOGGING_CONFIG",
            "HANGING_UPLOADS_DIR": str(uploads),
        },
    )
    url = instance.health_url(30)
    wait_for(lambda: sorted(uploads.glob("*.started")), bool, 90, "an upload hanging in the remote store")
    hung_at = float(rows(dsn, "SELECT extract(epoch FROM clock_timestamp())")[0][0])

    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        90,
        "every task resumed while the upload hangs",
    )
    # renewed for more than two leases after the upload began hanging: the loop never waited for it
    wait_for(
        lambda: lease_horizon(dsn),
        lambda h: h > hung_at + 2 * LEASE,
        4 * LEASE,
        "the leases renewed past two leases after the hang",
    )
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert metrics(url)["smart_triggerer_shards_handed_over_total"] == 0, "no shard lapsed or moved"
    resolved = Counter(
        ti for ti, op in rows(dsn, "SELECT ti_id::text, op FROM chaos.ti_audit WHERE op = 'resolved'")
    )
    assert len(resolved) == WAITS and set(resolved.values()) == {1}, resolved
    assert not list(uploads.glob("*.uploaded")), "the store never answered"

    instance.signal(signal.SIGTERM)
    assert instance.process is not None and instance.process.wait(timeout=30) == 0, instance.log_tail()
    said = [
        line
        for line in instance.log_path.read_text().splitlines()
        if "not uploaded to the remote store at exit" in line
    ]
    assert len(said) == 1 and "left=" in said[0], said


def _env() -> dict[str, str]:
    from tests.integration.test_smart_triggerer import ENV

    return dict(ENV)
