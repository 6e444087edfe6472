"""Creating the bridge's tables in Airflow's metadata database, safely when processes start at once."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

# One lock for every creator of the dataset_bridge schema (task-success bridge, outbox, inbox): concurrent
# CREATE SCHEMA/TABLE ... IF NOT EXISTS can still collide on the catalog, also across the three.
_LOCK_KEY = 7212400102

# Airflow stores an asset event's extra as json, which takes a NUL character (\u0000), an unpaired UTF-16
# surrogate or a number beyond numeric's range; jsonb refuses them. Whatever casts an event's extra to
# jsonb asks this first: NULL when the cast works, else PostgreSQL's reason (for json input, the message
# and detail name the cause, never the value).
JSONB_ERROR = """
CREATE OR REPLACE FUNCTION dataset_bridge.jsonb_error(value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    detail text;
BEGIN
    PERFORM CAST(value AS jsonb);
    RETURN NULL;
EXCEPTION WHEN data_exception THEN
    GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
    RETURN concat_ws(': ', SQLERRM, nullif(detail, ''));
END
$$
"""


def statements(ddl: str) -> list[str]:
    """``ddl`` split at the ``;`` outside ``$$``-quoted function bodies (write no ``;`` in a comment)."""
    found: list[str] = []
    current = ""
    for n, part in enumerate(ddl.split("$$")):
        if n % 2:  # a function body: kept whole
            current += f"$${part}$$"
            continue
        pieces = part.split(";")
        current += pieces[0]
        for piece in pieces[1:]:
            found.append(current)
            current = piece
    found.append(current)
    return [statement for statement in found if _has_code(statement)]


def _has_code(statement: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in statement.splitlines())


def apply(session: Any, ddl: str) -> None:
    """Run ``ddl`` (statements separated by ``;``) in the session's transaction, one creator at a time."""
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    for statement in statements(ddl):
        session.execute(text(statement))
