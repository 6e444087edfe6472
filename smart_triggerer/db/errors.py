"""What a database error means for the loop, by SQLSTATE (the same for psycopg2 and psycopg 3).

- an **outage**: the database cannot be reached (connection lost or refused, the server shutting down):
  retry everything later, blame nothing;
- **transient**: this statement met a lock it may not wait for (``lock_timeout``), a deadlock, a
  serialization failure, a cancel, a server short of resources: retry that event later, store the others;
- the **event's own** fault: the database refuses what this event carries and will refuse it again (a
  payload jsonb cannot hold, a value too long for an index: SQLSTATE classes 22, 23 and 54), or code of
  the event's path raised (a listener, a callback, the asset manager): the event that carries it fails
  alone;
- anything else is the **database's** refusal of every writer (read-only after a failover, a permission
  revoked, an I/O error, an internal error): no event is to blame, so every event is kept and the step is
  retried, as for an outage.

The driver's exception class is no guide: psycopg2 files "program limit exceeded" (54xxx) and most of
class 55 under ``OperationalError``, as it does a lost connection.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

OUTAGE_STATES = frozenset({"57P01", "57P02", "57P03"})  # admin shutdown, crash shutdown, cannot connect now
TRANSIENT_STATES = frozenset({"55P03", "40001", "40P01", "57014", "25P02"})  # lock timeout, serialization,
# deadlock, query cancelled, and a transaction an earlier statement aborted (a workload build that goes on
# after one row's refusal: the next row is not to blame, the build is tried again)
CONNECTION_CLASSES = ("OperationalError", "InterfaceError")
# data exception, integrity constraint violation, program limit exceeded: what one statement carried
EVENT_CLASSES = ("22", "23", "54")


def sqlstate(err: BaseException) -> str | None:
    orig = getattr(err, "orig", None) or err
    state = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    return str(state) if state else None


def is_outage(err: BaseException) -> bool:
    """The database could not be reached: retry later, blame no event."""
    if not isinstance(err, SQLAlchemyError):
        return False
    if isinstance(err, DBAPIError) and err.connection_invalidated:
        return True
    if lost_earlier(err):
        return True
    state = sqlstate(err)
    if state is None:
        # no answer from the server at all: the driver's connection-level errors
        orig = getattr(err, "orig", None)
        return isinstance(err, DBAPIError) and type(orig).__name__ in CONNECTION_CLASSES
    return state.startswith("08") or state in OUTAGE_STATES


def lost_earlier(err: BaseException) -> bool:
    """The transaction's connection was lost at an earlier statement whose error someone caught (a
    savepoint's handler, Airflow's job heartbeat): SQLAlchemy refuses the next one with
    ``PendingRollbackError: Can't reconnect until invalid (savepoint) transaction is rolled back``, its
    error code 8s2b. (7s2a, a flush that failed earlier, is not that: its cause may be an event's.)"""
    return isinstance(err, sa_exc.PendingRollbackError) and getattr(err, "code", None) == "8s2b"


def is_transient(err: BaseException) -> bool:
    """This statement may succeed if tried again a little later (a lock, a conflict, resources)."""
    state = sqlstate(err) if isinstance(err, SQLAlchemyError) else None
    return state is not None and (state in TRANSIENT_STATES or state.startswith("53"))


def blames_event(err: BaseException) -> bool:
    """The event being stored is at fault (its payload, its listeners): it fails alone, the others go on.
    False for an outage, a lock and any refusal that any other event would meet as well."""
    if not isinstance(err, SQLAlchemyError):
        return True  # a listener, a callback, the asset manager: code of this event's path
    if isinstance(err, (sa_exc.TimeoutError, sa_exc.DisconnectionError)):
        return False  # no connection to be had from the pool: nobody's fault but the database's
    if lost_earlier(err):
        # an earlier statement of this transaction lost its connection and that error was caught: the
        # database's fault, not the event's; it is stored again with the others
        return False
    if not isinstance(err, DBAPIError):
        return True  # SQLAlchemy refused the values before sending them, or the path misused a session
    state = sqlstate(err)
    return state is not None and state.startswith(EVENT_CLASSES)


def cause(err: BaseException) -> str:
    """The error's first line (never the statement's parameters: they may carry payloads)."""
    orig = getattr(err, "orig", None) or err
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}"


def storable(text: str) -> str:
    """``text`` as jsonb can hold it: no NUL, no unpaired surrogate (a cause may quote a payload)."""
    cleaned = text.replace("\x00", "\\u0000")
    return cleaned.encode("utf-8", "backslashreplace").decode("utf-8") if _has_surrogate(cleaned) else cleaned


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)
