"""The Smart Triggerer page's groups API at scale: milliseconds per call, without HTTP.

    .venv/bin/python -m bench.page_bench --waiters 50000 --dags 5 --write

Seeds ``--waiters`` deferred task instances (``--dags`` DAGs of one mapped task each, written as Airflow's
execution API writes a deferral) and their identities as an instance stores them, one instance holding
every shard; then times ``page.groups_page`` (its queries and JSON) for the first page, a later page and
a page past the last, as a user who may read every DAG and as one who may read one DAG, with the
waiters in few big groups and in many small ones (the identities are rewritten between the two shapes:
the page reads identities, never kwargs); each as the page's refresh finds it (the groups' order kept,
``page.GroupOrders``) and as the first request for a set of DAGs (the order read first). Each shape is
timed twice: first as the page finds fresh rows before autovacuum has analysed them (autovacuum held off
on the tables the page reads: no statistics at all for the first shape, the previous shape's for the
identities of the next), then after VACUUM ANALYZE.
Prints the medians; ``--write`` appends them to RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.triggerer_bench import _HOME, append_result, console  # sets Airflow's environment first
from devkit.devstack import AirflowConfig, migrate
from devkit.pgserver import postgres_dsn
from tests.helpers.airflow_orm import use_airflow_db
from tests.helpers.databases import create_database, drop_database, unique_name
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows

POLL_TRIGGER = "bench.triggers.PollTrigger"
SHARDS = 64
JOB_ID = 1
URL = "http://source.invalid"


@dataclass(frozen=True)
class Shape:
    name: str
    unique: int  # identities: waiter i waits on key i % unique


def seed(dsn: str, waiters: int, dags: int) -> list[str]:
    """``waiters`` deferred tasks over ``dags`` DAGs (waiter i of DAG d has key ``k{d * per_dag + i}``)."""
    per_dag = waiters // dags
    dag_ids = []
    for d in range(dags):
        started = time.monotonic()
        seeded = seed_deferred(
            dsn,
            _HOME / "dags",
            count=per_dag,
            classpath=POLL_TRIGGER,
            dag_id=f"page_{d}",
            kwargs_for=lambda i, d=d: {"url": URL, "key": f"k{d * per_dag + i}"},
        )
        dag_ids.append(seeded.dag_id)
        console.print(f"  seeded {seeded.dag_id}: {per_dag} waiters in {time.monotonic() - started:.0f}s")
    return dag_ids


def store_identities(dsn: str, shape: Shape) -> None:
    """Every waiter's identity as an instance computes and stores it (its key modulo ``shape.unique``),
    replacing those of the previous shape; one instance (job 1) holds every shard."""
    from airflow.utils.session import create_session

    from bench.triggers import PollTrigger
    from smart_triggerer.db.store import NewIdentity, Store
    from triggers.identity import IdentityPolicy

    policy = IdentityPolicy.with_extra([])
    found = rows(
        dsn,
        "SELECT t.id, ti.dag_id, ti.map_index FROM trigger t "
        "JOIN task_instance ti ON ti.trigger_id = t.id ORDER BY t.id",
    )
    per_dag = len(found) // len({r[1] for r in found})
    by_key: dict[int, NewIdentity] = {}
    identities = []
    for trigger_id, dag_id, map_index in found:
        key = (int(dag_id.split("_")[1]) * per_dag + map_index) % shape.unique
        if key not in by_key:
            kwargs = PollTrigger(url=URL, key=f"k{key}").serialize()[1]
            identity = policy.identity(POLL_TRIGGER, kwargs, trigger_id)
            by_key[key] = NewIdentity(
                0,
                identity.hash,
                identity.shard(SHARDS),
                identity.dedupable,
                {},
                description=identity.description,
            )
        shared = by_key[key]
        identities.append(
            NewIdentity(
                trigger_id,
                shared.identity_hash,
                shared.shard,
                shared.dedupable,
                {"poll_interval": ["min", 5.0]},
                description=shared.description,
            )
        )
    with create_session() as session:
        store = Store(session)
        store.migrate(SHARDS)
        store.register(JOB_ID, "bench-host", 100_000, None, health_url=None, shards=SHARDS)
        store.claim_shards(JOB_ID, range(SHARDS), 86_400, None)
        session.execute(_sql("DELETE FROM smart_triggerer.trigger_identity"))
        store.insert_identities(identities)
    console.print(f"  {len(identities)} identities in {len(by_key)} groups ({shape.name})")


PAGE_TABLES = "task_instance, trigger, smart_triggerer.trigger_identity"


def _execute(dsn: str, *statements: str) -> None:
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


def hold_autovacuum(dsn: str, *, held: bool) -> None:
    """Keep autovacuum off the page's tables while the unanalysed case is timed (it would analyse them
    within a minute or so of the seeding, whenever its naptime falls). Our schema's table exists only once
    the first shape is stored: it is held from the second shape on, and ``analysed_meanwhile`` tells if
    autovacuum came first."""
    setting = "SET (autovacuum_enabled = off)" if held else "RESET (autovacuum_enabled)"
    _execute(dsn, *(f"ALTER TABLE IF EXISTS {table} {setting}" for table in PAGE_TABLES.split(", ")))


def analysed_meanwhile(dsn: str) -> list[str]:
    """The page's tables autovacuum analysed anyway (the unanalysed figures are then not what they say)."""
    return [
        r[0]
        for r in rows(
            dsn,
            "SELECT relname FROM pg_stat_user_tables "
            "WHERE last_autoanalyze IS NOT NULL "
            "AND relname IN ('task_instance', 'trigger', 'trigger_identity')",
        )
    ]


def vacuum(dsn: str) -> None:
    """As autovacuum leaves the tables a while after a burst of deferrals: statistics and visibility map."""
    _execute(dsn, f"VACUUM ANALYZE {PAGE_TABLES}")


def _sql(statement: str) -> object:
    from sqlalchemy import text

    return text(statement)


def median_ms(call: Callable[[], object], times: int) -> float:
    call()  # warm: connections, plans, caches
    took = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


def time_shape(dag_ids: list[str], repeat: int) -> list[tuple[str, float]]:
    """Median milliseconds of the groups API body for each page and user: as the page's 10 s refresh finds
    it (the order kept), and as the first request for a set of DAGs does (the order read first)."""
    from smart_triggerer.web import page

    def groups(readable: list[str], offset: int, *, cold: bool) -> Callable[[], object]:
        viewer = page.Viewer(frozenset(readable), views_triggers=True)

        def call() -> object:
            if cold:
                page.GROUP_ORDERS.clear()
            return page.groups_page(viewer, page.DEFAULT_PAGE, offset)

        return call

    page.GROUP_ORDERS.clear()
    total = page.groups_page(page.Viewer(frozenset(dag_ids), views_triggers=True), 1, 0)["total"]
    middle = total // 2 // page.DEFAULT_PAGE * page.DEFAULT_PAGE
    cases = [
        ("every DAG, first page", dag_ids, 0, False),
        ("every DAG, page at the middle", dag_ids, middle, False),
        ("every DAG, past the last page", dag_ids, total + page.DEFAULT_PAGE, False),
        ("one DAG, first page", dag_ids[:1], 0, False),
        ("every DAG, first page, order read first", dag_ids, 0, True),
        ("one DAG, first page, order read first", dag_ids[:1], 0, True),
    ]
    return [
        (name, median_ms(groups(readable, offset, cold=cold), repeat))
        for name, readable, offset, cold in cases
    ]


@contextmanager
def seeded_database(args: argparse.Namespace) -> Iterator[tuple[str, list[str]]]:
    """A migrated metadata database with the waiters seeded (``--dsn``: one seeded before, kept)."""
    if args.dsn:
        use_airflow_db(args.dsn)
        yield args.dsn, [r[0] for r in rows(args.dsn, "SELECT DISTINCT dag_id FROM task_instance ORDER BY 1")]
        return
    with postgres_dsn() as server_dsn:
        name = unique_name("st_page_bench")
        dsn = create_database(server_dsn, name)
        try:
            console.print("migrating a metadata database")
            migrate(
                AirflowConfig(
                    home=_HOME / "page",
                    database_dsn=dsn,
                    dags_folder=_HOME / "dags",
                    fernet_key=_fernet_key(),
                )
            )
            hold_autovacuum(dsn, held=True)  # the first case times rows never analysed
            yield dsn, seed(dsn, args.waiters, args.dags)
        finally:
            if args.keep:
                console.print(f"kept: --dsn {dsn}")
            else:
                drop_database(server_dsn, name)


def _fernet_key() -> str:
    import os

    return os.environ["AIRFLOW__CORE__FERNET_KEY"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=50_000)
    parser.add_argument("--dags", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=9, help="calls per case (the median is shown)")
    parser.add_argument("--dsn", help="a database seeded by an earlier --keep run (its waiters are reused)")
    parser.add_argument("--keep", action="store_true", help="keep the seeded database and print its DSN")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    shapes = [Shape("few big groups", 50), Shape("many small groups", max(1, args.waiters * 3 // 5))]
    columns = [f"{shape.name}, {when}" for shape in shapes for when in ("before ANALYZE", "after")]
    lines = ["| groups API body (median ms) | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    notes = []
    with seeded_database(args) as (dsn, dag_ids):
        waiters = rows(dsn, "SELECT count(*) FROM task_instance WHERE state = 'deferred'")[0][0]
        results = []
        try:
            for shape in shapes:
                hold_autovacuum(dsn, held=True)
                store_identities(dsn, shape)
                for when in ("before ANALYZE", "after"):
                    if when == "after":
                        if analysed := analysed_meanwhile(dsn):
                            notes.append(
                                f"autovacuum had analysed {', '.join(analysed)} before the "
                                f"{shape.name} case before ANALYZE ended"
                            )
                        vacuum(dsn)
                    results.append(time_shape(dag_ids, args.repeat))
                    for name, took in results[-1]:
                        console.print(f"  {shape.name}, {when}: {name}: {took:.1f} ms")
        finally:
            hold_autovacuum(dsn, held=False)
    for index, (name, _took) in enumerate(results[0]):
        lines.append(f"| {name} | " + " | ".join(f"{r[index][1]:.1f}" for r in results) + " |")
    notes.append(
        f"Before ANALYZE: {shapes[0].name} with no statistics on any table (seeded with autovacuum "
        f"held off{'' if not args.dsn else '; --dsn: as the earlier run left them'}); the later "
        "shapes with statistics of the previous shape's identities (the tasks and triggers are the "
        "same rows)."
    )
    head = f"{waiters} deferred waiters over {len(dag_ids)} DAGs, {SHARDS} shards."
    markdown = "\n\n".join([head, "\n".join(lines), "\n".join(f"- {note}" for note in notes)])
    console.print(markdown)
    if args.write:
        append_result("Page groups API", "bench.page_bench", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
