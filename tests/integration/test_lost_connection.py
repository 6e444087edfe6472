"""A connection lost in the middle of a transaction, on a real PostgreSQL: an outage for the loop (every
event kept and stored again), never an event's own fault (its tasks failed)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg2
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, OperationalError, PendingRollbackError
from sqlalchemy.orm import Session

from smart_triggerer.db.errors import blames_event, is_outage, is_transient
from smart_triggerer.supervisor.fanout import delete_unused


@pytest.fixture
def session(pg_db: str) -> Iterator[Session]:
    """A session inside a transaction (a statement run), its connection checked out."""
    engine = sa.create_engine(pg_db.replace("postgresql://", "postgresql+psycopg2://", 1))
    session = Session(engine)
    session.execute(sa.text("SELECT 1"))
    yield session
    session.close()
    engine.dispose()


def end_its_connection(session: Session, dsn: str) -> None:
    """What PostgreSQL restarting or an operator's pg_terminate_backend does to the session's backend."""
    pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar()
    killer = psycopg2.connect(dsn)
    killer.autocommit = True
    try:
        with killer.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
    finally:
        killer.close()


def test_a_connection_lost_inside_a_caught_savepoint_is_an_outage_at_the_next_statement(
    session: Session, pg_db: str
) -> None:
    with pytest.raises(OperationalError), session.begin_nested():
        end_its_connection(session, pg_db)
        session.execute(sa.text("SELECT 2"))
    with pytest.raises(PendingRollbackError) as later:  # what a commit after a caught error meets
        session.execute(sa.text("SELECT 3"))
    assert is_outage(later.value)
    assert not blames_event(later.value)


def test_unused_trigger_rows_raise_the_outage_instead_of_leaving_a_dead_transaction(
    session: Session, pg_db: str
) -> None:
    """The fan-out deletes trigger rows in a savepoint whose other errors it leaves to the sweep; a lost
    connection is raised, so the event's transaction fails as an outage and its event is stored again."""
    end_its_connection(session, pg_db)
    with pytest.raises(OperationalError) as raised:
        delete_unused(session, [1, 2])
    assert is_outage(raised.value)


def test_a_statement_after_an_aborting_error_is_tried_again_not_blamed(session: Session) -> None:
    """What a workload build meets at the next row after one row's refusal (Airflow's build goes on in the
    same transaction): the next row is not at fault, so it must not be marked unbuildable for good."""
    with pytest.raises(DBAPIError):
        session.execute(sa.text("SELECT 1 / 0"))
    with pytest.raises(DBAPIError) as later:
        session.execute(sa.text("SELECT 1"))
    assert "current transaction is aborted" in str(later.value)
    assert is_transient(later.value) and not blames_event(later.value) and not is_outage(later.value)
