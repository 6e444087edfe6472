"""Cross-deployment relay: events per second relayed and latency from A's asset event to B's.

    .venv/bin/python -m bench.relay_bench --rate 50 --seconds 20 --burst 50000 --write

Deployment A is a migrated metadata database whose events are created through ``OutboxAssetManager``
(the outbox row in the same transaction, as Airflow's own code paths do); deployment B is a real
Airflow (api-server with the inbox plugin, scheduler, dag-processor, a consumer DAG on the asset and
``dataset-bridge run`` for the reconciler) on its own database. The relay (``dataset-bridge relay``)
runs between them. Steady phase: ``--rate`` events/s, one transaction each, for ``--seconds``: latency = B's
``asset_event.timestamp`` - A's (same host clock). Backlog phase: ``--burst`` events made while the relay
is stopped; throughput = events / (relay start -> last event in B).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from typing import Any

from bench.triggerer_bench import _HOME, ROOT, append_result, console, wait_until
from devkit.devstack import AirflowConfig, AirflowStack, migrate
from devkit.pgserver import postgres_dsn
from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.databases import create_database, drop_database, unique_name
from tests.helpers.waiting import rows

URI = "warehouse://dds/h_user"


def add_asset_b(dsn: str) -> None:
    import psycopg2

    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            'INSERT INTO asset (name, uri, "group", extra, created_at, updated_at) '
            "VALUES (%s, %s, 'asset', '{}', now(), now())",
            (URI, URI),
        )
        cur.execute("INSERT INTO asset_active (name, uri) VALUES (%s, %s)", (URI, URI))
    conn.close()


def add_asset_a() -> Any:
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        asset = AssetModel(name=URI, uri=URI)
        session.add(asset)
        session.add(AssetActive(name=URI, uri=URI))
        session.flush()
        return asset.to_serialized()


def emit(manager: Any, asset: Any, count: int) -> None:
    from airflow.utils.session import create_session

    with create_session() as session:
        for n in range(count):
            manager.register_asset_change(asset=asset, extra={"n": n}, session=session)


def latencies(a_dsn: str, b_dsn: str, first_a_id: int) -> tuple[list[float], float, float]:
    a_times = {
        int(r[0]): float(r[1])
        for r in rows(
            a_dsn, "SELECT id, extract(epoch FROM timestamp) FROM asset_event WHERE id >= %s", first_a_id
        )
    }
    b_times = {
        int(r[0]): float(r[1])
        for r in rows(
            b_dsn,
            "SELECT CAST(CAST(extra AS jsonb) ->> 'source_event_id' AS bigint), "
            "extract(epoch FROM timestamp) FROM asset_event",
        )
    }
    values = sorted(b_times[i] - a_times[i] for i in a_times if i in b_times)
    return values, min(a_times.values()), max(b_times[i] for i in a_times)


CONSUMER = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset

USERS = Asset(name="warehouse://dds/h_user", uri="warehouse://dds/h_user")
with DAG(dag_id="consume_users", schedule=[USERS], start_date=pendulum.datetime(2024, 1, 1),
         catchup=False):
    EmptyOperator(task_id="consume")
"""


def consumed_latencies(b_dsn: str) -> list[float]:
    """Per consumed event in B: its consumer run's creation (queued_at) minus the event's timestamp."""
    return sorted(
        float(r[0])
        for r in rows(
            b_dsn,
            "SELECT extract(epoch FROM dr.queued_at - e.timestamp) FROM dagrun_asset_event c "
            "JOIN dag_run dr ON dr.id = c.dag_run_id JOIN asset_event e ON e.id = c.event_id",
        )
    )


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def start_b(stack_b: AirflowStack) -> None:
    """B: the asset, a consumer DAG scheduled on it, core Airflow and the bridge (reconciler, defaults)."""
    add_asset_b(stack_b.config.database_dsn)
    (stack_b.config.dags_folder / "consumer.py").write_text(CONSUMER)
    stack_b.start_core()
    stack_b.wait_for_dags(["consume_users"])
    stack_b.unpause("consume_users")
    stack_b.start_bridge()


def run(args: argparse.Namespace, server: str) -> dict[str, Any]:
    names = [unique_name("st_relay_a"), unique_name("st_relay_b")]
    a_dsn = create_database(server, names[0])
    home = _HOME / "relay"
    secret = secrets.token_urlsafe(32)
    stack_b: AirflowStack | None = None
    stack_a: AirflowStack | None = None
    try:
        config_a = AirflowConfig(
            home=home / "a", database_dsn=a_dsn, dags_folder=home / "dags_a", extra={"PYTHONPATH": str(ROOT)}
        )
        migrate(config_a)
        b_dsn = create_database(server, names[1], template=names[0])
        config_b = AirflowConfig(
            home=home / "b",
            database_dsn=b_dsn,
            dags_folder=home / "dags_b",
            extra={
                "AIRFLOW__DATASET_BRIDGE__INBOX_SECRETS": json.dumps({"deployment_a": secret}),
                "AIRFLOW__DATASET_BRIDGE__INBOX_ALLOWED_ASSETS": json.dumps({"deployment_a": [f"uri:{URI}"]}),
            },
        )
        for folder in (config_a.dags_folder, config_b.dags_folder):
            folder.mkdir(parents=True, exist_ok=True)
        stack_b = AirflowStack(config_b)
        start_b(stack_b)
        routes = home / "routes.yaml"
        routes.write_text(
            f"source: deployment_a\ntargets:\n  deployment_b:\n"
            f"    url: {config_b.api_url}/dataset-bridge/inbox\n"
            f"    secret_env: BRIDGE_SECRET_B\n    assets: [{URI}]\n"
        )
        use_airflow_db(a_dsn)
        from dataset_bridge.asset_manager import OutboxAssetManager

        manager = OutboxAssetManager(routes=str(routes))
        asset = add_asset_a()
        stack_a = AirflowStack(config_a)
        relay = stack_a.add_relay(["--routes", str(routes)], {"BRIDGE_SECRET_B": secret})
        wait_until(
            lambda: rows(a_dsn, "SELECT to_regclass('dataset_bridge.outbox') IS NOT NULL")[0][0],
            60,
            "the relay to create the outbox",
        )

        console.print(f"steady: {args.rate} events/s for {args.seconds}s")
        total = int(args.rate * args.seconds)
        started = time.monotonic()
        for n in range(total):
            emit(manager, asset, 1)
            time.sleep(max(0.0, started + (n + 1) / args.rate - time.monotonic()))
        wait_until(
            lambda: rows(b_dsn, "SELECT count(*) FROM asset_event")[0][0] >= total,
            120,
            "steady events in B",
            interval=0.2,
        )
        steady, _, _ = latencies(a_dsn, b_dsn, 1)
        wait_until(
            lambda: len(consumed_latencies(b_dsn)) >= total,
            180,
            "B's consumer runs to consume them",
            interval=0.5,
        )
        consumed = consumed_latencies(b_dsn)

        console.print(f"backlog: {args.burst} events made while the relay is stopped, then drained")
        stack_a.retire(relay)
        first = int(rows(a_dsn, "SELECT coalesce(max(id), 0) + 1 FROM asset_event")[0][0])
        for _ in range(args.burst // 100):
            emit(manager, asset, 100)
        relay_started = time.time()
        stack_a.add_relay(["--routes", str(routes)], {"BRIDGE_SECRET_B": secret}, name="relay-2")
        wait_until(
            lambda: rows(b_dsn, "SELECT count(*) FROM asset_event")[0][0] >= total + args.burst,
            600,
            "the backlog in B",
            interval=0.2,
        )
        burst, _a_first, b_last = latencies(a_dsn, b_dsn, first)
        duplicates = rows(
            b_dsn,
            "SELECT count(*) - count(DISTINCT CAST(extra AS jsonb) ->> 'source_event_id') FROM asset_event",
        )[0][0]
        return {
            "steady_events": len(steady),
            "steady_p50": pct(steady, 0.5),
            "steady_p99": pct(steady, 0.99),
            "consumed_p50": pct(consumed, 0.5),
            "consumed_p99": pct(consumed, 0.99),
            "burst_made": args.burst // 100 * 100,
            "burst_events": len(burst),
            "burst_rate": len(burst) / (b_last - relay_started),
            "duplicates": int(duplicates),
        }
    finally:
        for stack in (stack_a, stack_b):
            if stack is not None:
                stack.stop()
        for name in names:
            drop_database(server, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--burst", type=int, default=5000)
    parser.add_argument("--write", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    with postgres_dsn() as server:
        result = run(args, server)
    lost = result["burst_made"] - result["burst_events"]
    line = (
        f"steady {args.rate:.0f}/s x {result['steady_events']} events: A->B latency p50 "
        f"{result['steady_p50']:.3f}s, p99 {result['steady_p99']:.3f}s; B event -> consumer run that "
        f"consumed it p50 {result['consumed_p50']:.1f}s, p99 {result['consumed_p99']:.1f}s (scheduler, "
        f"reconciler at defaults); a backlog of {result['burst_events']} events relayed at "
        f"{result['burst_rate']:.0f} events/s (relay start to the last event in B, process start-up "
        f"included); duplicates in B: {result['duplicates']}, lost: {lost}"
    )
    console.print(line)
    if args.write:
        title = "Cross-deployment relay (outbox -> relay -> inbox, one host)"
        append_result(title, "bench.relay_bench", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
