"""Which errors end a wait and which are tried again; which errors blame an event and which the database."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy.exc import PendingRollbackError

from smart_triggerer.db.errors import blames_event, is_outage
from triggers.pg import SourceError, is_permanent


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.UndefinedTableError,
        asyncpg.ReadOnlySQLTransactionError,
        asyncpg.ActiveSQLTransactionError,
        asyncpg.InsufficientPrivilegeError,
    ],
)
def test_errors_in_the_check_itself_end_the_wait(error: type[Exception]) -> None:
    assert is_permanent(error("refused"))
    assert is_permanent(SourceError("a check may only read"))


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.IdleInTransactionSessionTimeoutError,
        asyncpg.TransactionTimeoutError,
        asyncpg.InFailedSQLTransactionError,
        asyncpg.AdminShutdownError,
        asyncpg.exceptions.InternalClientError,
        asyncpg.InterfaceError,
        OSError,
    ],
)
def test_the_sources_own_limits_and_its_going_away_are_tried_again(error: type[Exception]) -> None:
    """A source that ends a transaction a stalled triggerer left open (idle_in_transaction_session_timeout,
    transaction_timeout) says nothing of the check: the same check succeeds next time."""
    assert not is_permanent(error("gone for now"))


def test_a_lost_connection_caught_earlier_is_the_databases_but_a_failed_flush_may_be_the_events() -> None:
    lost = PendingRollbackError(
        "Can't reconnect until invalid savepoint transaction is rolled back.", code="8s2b"
    )
    assert is_outage(lost) and not blames_event(lost)
    flushed = PendingRollbackError(
        "This Session's transaction has been rolled back due to a previous exception during flush.",
        code="7s2a",
    )
    assert not is_outage(flushed) and blames_event(flushed)
