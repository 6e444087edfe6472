"""Push latency of TableLoadTrigger under the smart triggerer: INSERT + NOTIFY -> task leaves DEFERRED.

    .venv/bin/python -m bench.push_bench --flips 100 --write

N deferred task instances each wait (poll interval 300 s, ``notify_channel``) for their own table in a
real load-status table. One flip: commit a SUCCESS row and NOTIFY in one transaction, then wait until that
task instance's ``scheduled_dttm`` is set; latency = ``scheduled_dttm`` - commit time. Target: p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import asyncpg

from bench.triggerer_bench import _HOME, ROOT, append_result, console, wait_until
from devkit.devstack import AirflowConfig, AirflowStack, migrate
from devkit.pgserver import postgres_dsn
from tests.helpers.databases import create_database, drop_database, unique_name
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows
from triggers.table_load import TableLoadTrigger

STATUS_DDL = """
CREATE SCHEMA meta;
CREATE TABLE meta.detail_process_table_status (
    id bigserial PRIMARY KEY, table_name text, status text, created_dttm timestamptz NOT NULL DEFAULT now()
);
"""


async def flip(dsn: str, table: str) -> float:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO meta.detail_process_table_status (table_name, status) VALUES ($1, 'SUCCESS')",
                table,
            )
            await conn.execute("NOTIFY table_loads")
        return time.time()  # just after COMMIT returned
    finally:
        await conn.close()


def run(args: argparse.Namespace, server_dsn: str) -> list[float]:
    airflow_db, warehouse = unique_name("st_push_af"), unique_name("st_push_wh")
    af_dsn = create_database(server_dsn, airflow_db)
    wh_dsn = create_database(server_dsn, warehouse)
    home = _HOME / "push"
    config = AirflowConfig(
        home=home / "airflow",
        database_dsn=af_dsn,
        dags_folder=home / "dags",
        fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
        extra={
            "AIRFLOW_CONN_WAREHOUSE": wh_dsn,
            "PYTHONPATH": str(ROOT),
            "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
        },
    )
    stack = AirflowStack(config)
    try:
        migrate(config)
        asyncio.run(_ddl(wh_dsn))
        os.environ["AIRFLOW_CONN_WAREHOUSE"] = wh_dsn
        seeded = seed_deferred(
            af_dsn,
            config.dags_folder,
            count=args.flips,
            classpath="triggers.table_load.TableLoadTrigger",
            kwargs_for=lambda i: TableLoadTrigger(
                "warehouse", [f"t{i}"], poll_interval=300.0, notify_channel="table_loads"
            ).serialize()[1],
            dag_id="push_bench",
        )
        stack.start_smart_triggerer("smart", capacity=args.flips)
        wait_until(
            lambda: (
                rows(af_dsn, "SELECT count(*) FROM trigger WHERE triggerer_id IS NOT NULL")[0][0]
                == args.flips
            ),
            120,
            "every waiter loaded",
            interval=0.5,
        )
        time.sleep(5)  # coroutines started, first checks done, listening
        latencies = []
        for i in range(args.flips):
            committed = asyncio.run(flip(wh_dsn, f"t{i}"))
            wait_until(
                lambda i=i: (
                    rows(
                        af_dsn,
                        "SELECT state FROM task_instance WHERE dag_id = 'push_bench' AND map_index = %s",
                        i,
                    )[0][0]
                    != "deferred"
                ),
                30,
                f"flip {i}",
                interval=0.02,
            )
            resumed = rows(
                af_dsn,
                "SELECT extract(epoch FROM scheduled_dttm) FROM task_instance "
                "WHERE dag_id = 'push_bench' AND map_index = %s",
                i,
            )[0][0]
            latencies.append(float(resumed) - committed)
        assert len(seeded.ti_ids) == args.flips
        return latencies
    finally:
        stack.stop()
        drop_database(server_dsn, airflow_db)
        drop_database(server_dsn, warehouse)


async def _ddl(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    await conn.execute(STATUS_DDL)
    await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=100)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    with postgres_dsn() as server_dsn:
        latencies = sorted(run(args, server_dsn))
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    line = f"{args.flips} flips: p50 {p50:.3f}s, p99 {p99:.3f}s, max {latencies[-1]:.3f}s (target p99 <= 1 s)"
    console.print(line)
    if args.write:
        title = "Push latency (TableLoadTrigger, LISTEN/NOTIFY, poll interval 300 s)"
        append_result(title, "bench.push_bench", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
