"""The errors a user can fix, and the exit code of each kind (docs/reference.md, Exit codes). Every part
of the service raises them; the command lines (``smart_triggerer/cli/errors.py``) turn them into one line
on stderr and the exit code."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Documented in docs/reference.md (Exit codes); keep them stable."""

    CONFIG = 2  # an invalid setting, argument or file
    DATABASE_UNREACHABLE = 3  # the database cannot be reached or refuses the login
    DATABASE_UNSUPPORTED = 4  # the metadata database is not PostgreSQL
    SHARD_COUNT = 5  # [smart_triggerer] shards differs from the deployment's
    DATABASE_PRIVILEGE = 6  # the database role lacks a privilege (e.g. CREATE on the database)
    AIRFLOW_UNSUPPORTED = 7  # the installed Airflow is outside the range this release is tested with
    SCHEMA_TOO_NEW = 8  # a newer release changed the smart_triggerer schema in a way this one cannot run on
    AIRFLOW_NOT_MIGRATED = 9  # `airflow db migrate` never ran on the metadata database


class UserError(Exception):
    """An error whose message already says what to do; ``exit_code`` tells the kind."""

    exit_code = ExitCode.CONFIG


class UnsupportedDatabase(UserError):
    exit_code = ExitCode.DATABASE_UNSUPPORTED


class DatabaseUnreachable(UserError):
    exit_code = ExitCode.DATABASE_UNREACHABLE


class UnsupportedAirflow(UserError):
    exit_code = ExitCode.AIRFLOW_UNSUPPORTED


class AirflowNotMigrated(UserError):
    exit_code = ExitCode.AIRFLOW_NOT_MIGRATED
