"""Errors a user can fix: one line on stderr saying what is wrong and how to fix it, and an exit code each.

``smart-triggerer`` and ``dataset-bridge`` share these; ``--verbose`` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import socket
import sys
import traceback
from collections.abc import Callable, Iterator

from sqlalchemy.exc import ArgumentError

from smart_triggerer.errors import ExitCode, UserError


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        # only explicit causes: an error raised while handling another is a different error
        current = current.__cause__


def _connection_failure(err: BaseException) -> str | None:
    """The driver's first line when ``err`` means 'cannot connect or log in', else None."""
    import asyncpg
    from sqlalchemy.exc import DBAPIError, OperationalError

    if isinstance(err, OperationalError) and err.orig is not None and _is_connect(err):
        return _first_line(str(err.orig))
    if isinstance(err, DBAPIError) and err.connection_invalidated:
        return _first_line(str(err.orig))
    if isinstance(
        err,
        asyncpg.exceptions.InvalidAuthorizationSpecificationError
        | asyncpg.exceptions.InvalidCatalogNameError
        | asyncpg.exceptions.CannotConnectNowError,
    ):
        return _first_line(str(err))
    return _socket_failure(err)


def _socket_failure(err: BaseException) -> str | None:
    if isinstance(err, ConnectionRefusedError):
        # asyncpg says "[Errno 111] Connect call failed ('127.0.0.1', 5432)"
        address = str(err).rpartition("failed")[2].strip(" ()").replace("'", "").replace(", ", ":")
        return f"Connection refused by {address}" if address else "Connection refused"
    if isinstance(err, socket.gaierror):
        return f"host name not found: {err}"
    if isinstance(err, OSError) and "Connect call failed" in str(err):
        # asyncio's "Multiple exceptions: [Errno 111] Connect call failed ..." (a name with several addresses)
        return _first_line(str(err))
    return None


# what libpq and PostgreSQL say when a connection or login fails (not when a statement fails)
_CONNECT_FAILURES = (
    "could not connect",
    "connection refused",
    "connection to server at",
    "connection to server on",
    "password authentication failed",
    "no pg_hba.conf entry",
    "could not translate host name",
    "timeout expired",
    "the database system is starting up",
    "the database system is shutting down",
)


def _is_connect(err: BaseException) -> bool:
    text = str(err).lower()
    unknown = "does not exist" in text and ('role "' in text or 'database "' in text)
    return unknown or any(phrase in text for phrase in _CONNECT_FAILURES)


def _privilege_failure(err: BaseException) -> str | None:
    import asyncpg
    from sqlalchemy.exc import ProgrammingError

    if isinstance(err, asyncpg.exceptions.InsufficientPrivilegeError):
        return _first_line(str(err))
    if not isinstance(err, ProgrammingError):
        return None
    code = getattr(err.orig, "pgcode", None) or getattr(err.orig, "sqlstate", None)  # psycopg2 / psycopg
    return _first_line(str(err.orig)) if code == "42501" else None  # insufficient_privilege


def _first_line(text: str) -> str:
    lines = (line.strip().removeprefix("connection failed: ") for line in text.strip().splitlines())
    return next((line for line in lines if line), "")


def _malformed_database_url(err: BaseException) -> str | None:
    """The parser's complaint when Airflow could not read [database] sql_alchemy_conn at import."""
    if not isinstance(err, ValueError | ArgumentError):
        return None
    frames = traceback.extract_tb(err.__traceback__)
    if not any(frame.filename.replace("\\", "/").endswith("airflow/settings.py") for frame in frames):
        return None
    return _first_line(str(err)) or type(err).__name__


def explain(err: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for an error the user can fix; None for a bug (the traceback is wanted)."""
    for link in _chain(err):
        if isinstance(link, UserError):  # also an invalid setting, a shard count differing (triggerer/)
            return str(link), link.exit_code
        malformed = _malformed_database_url(link)
        if malformed is not None:
            # never the URL itself: it may hold the password
            return (
                f"cannot parse [database] sql_alchemy_conn ({malformed}): it must be a URL such as "
                "postgresql://user:password@host:5432/airflow",
                ExitCode.CONFIG,
            )
        denied = _privilege_failure(link)
        if denied is not None:
            return (
                f"the database role lacks a privilege ({denied}): see docs/operations/install.md for "
                "the privileges the smart triggerer and the dataset bridge need",
                ExitCode.DATABASE_PRIVILEGE,
            )
        reason = _connection_failure(link)
        if reason is not None:
            return (
                f"cannot reach the database ({reason}): is PostgreSQL running, and are the URL and "
                "credentials in [database] sql_alchemy_conn right?",
                ExitCode.DATABASE_UNREACHABLE,
            )
    return None


def guarded(prog: str, verbose: bool, command: Callable[[], int]) -> int:
    """Run ``command``; an error the user can fix becomes one line on stderr and its exit code."""
    try:
        return command()
    except Exception as err:
        found = explain(err)
        if found is None:
            raise
        message, code = found
        if verbose:
            traceback.print_exc()
        print(f"{prog}: error: {message}", file=sys.stderr)
        return int(code)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command of both CLIs takes."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="on an error, print the traceback as well as the one-line message",
    )
