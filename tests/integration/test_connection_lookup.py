"""A wait whose connection lives in the metadata database, looked up while that lookup fails.

Airflow's triggerer answers a trigger's connection lookup through its supervisor; when the metadata
database cannot answer (restarting, a migration holding the ``connection`` table), the trigger is told
"The conn_id `x` isn't defined", exactly as for a conn_id that does not exist. Here the table is renamed
away while the waits start, so every lookup fails, and back once one has failed: the waits must go on and
resume on their condition, not fail their tasks.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from devkit.devstack import AirflowStack
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import execute, rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import ENV, metrics

SQL_CONDITION = "triggers.sql_condition.SqlConditionTrigger"
LOOKING_AGAIN = "connection not found; looking it up again before failing the wait"


def trigger_logs(stack: AirflowStack) -> str:
    return "".join(
        path.read_text(errors="replace") for path in (stack.config.home / "logs").rglob("*.trigger.*.log")
    )


def test_waits_started_while_connection_lookups_fail_resume_on_their_condition(
    airflow_stack: AirflowStack, pg_db: str
) -> None:
    dsn = airflow_stack.config.database_dsn
    execute(pg_db, "CREATE TABLE flags (done boolean NOT NULL)")
    execute(pg_db, "INSERT INTO flags VALUES (false)")
    source = urlsplit(pg_db)
    # the connection lives in the metadata database, as in most deployments (no AIRFLOW_CONN_ variable)
    execute(
        dsn,
        "INSERT INTO connection (conn_id, conn_type, host, port, schema, login, is_encrypted, "
        "is_extra_encrypted) VALUES ('meta_warehouse', 'postgres', %s, %s, %s, %s, false, false)",
        source.hostname,
        source.port or 5432,
        source.path.lstrip("/"),
        source.username,
    )
    seeded = seed_deferred(
        dsn,
        airflow_stack.config.dags_folder,
        count=4,
        classpath=SQL_CONDITION,
        kwargs_for=lambda i: {
            "conn_id": "meta_warehouse",
            "poll_interval": 0.5,
            "sql": "SELECT bool_or(done) FROM flags",
        },
    )
    execute(dsn, "ALTER TABLE connection RENAME TO connection_away")
    try:
        instance = airflow_stack.start_smart_triggerer("smart-triggerer", env=ENV)
        wait_for(
            lambda: metrics(instance.health_url()),
            lambda m: m.get("smart_triggerer_coroutines") == 1,
            60,
            "the waits' one coroutine to run",
        )
        wait_for(
            lambda: trigger_logs(airflow_stack),
            lambda text: LOOKING_AGAIN in text,
            60,
            "the coroutine's connection lookup to fail (its trigger log says so)",
        )
    finally:
        execute(dsn, "ALTER TABLE connection_away RENAME TO connection")
    execute(pg_db, "UPDATE flags SET done = true")
    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        90,
        "every wait to resume",
    )
    for (value,) in rows(dsn, "SELECT next_kwargs FROM task_instance WHERE dag_id = %s", seeded.dag_id):
        payload = json.loads(value) if isinstance(value, str) else value
        assert payload["event"]["status"] == "success", payload  # not "Trigger failure"
