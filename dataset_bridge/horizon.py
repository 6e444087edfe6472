"""Which ids of a table are final: no transaction that may still commit a row with a lower id is open.

Ids come from a sequence when a row is written, not when it commits, so a lower id can commit after a
higher one was read. The relay must not send an outbox row past one that may still commit (a later event
would overtake an earlier one), nor the sweeper move its cursor over ``asset_event`` past it (the event
would never get its outbox row). Neither uses a clock: what a row's host thinks the time is does not
matter.

How: a writer locks the table (``RowExclusiveLock``, held until its transaction ends) before it draws an
id. So reading the sequence's last value and *then* the transactions holding that lock gives every open
transaction that may hold an id at or below that value; once all of them have ended (a later look finds
none of them), every id up to the value is final. Read with no writer open, the value is final at once.
The table's sequence must not cache values (``CACHE 1``, PostgreSQL's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

# the table's name is the one parameter: $1 for asyncpg, :table for SQLAlchemy
_LAST_ID = """
SELECT coalesce(pg_sequence_last_value(CAST(pg_get_serial_sequence({table}, 'id') AS regclass)), 0)
"""
_WRITERS = """
SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{{}}') FROM pg_locks
WHERE locktype = 'relation' AND mode = 'RowExclusiveLock' AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND relation = CAST({table} AS regclass) AND pid IS DISTINCT FROM pg_backend_pid()
"""


@dataclass
class Horizon:
    """Ids up to ``final`` are final; ``waiting``: a last id read and the writers that were open then."""

    final: int = 0
    waiting: tuple[int, frozenset[str]] | None = None

    def observe(self, last_id: int, writers: frozenset[str]) -> int:
        """What a look (the sequence's last id, then the open writers) proves; the ids now final."""
        if self.waiting is not None and not self.waiting[1] & writers:
            self.final = max(self.final, self.waiting[0])  # every writer open back then has ended
            self.waiting = None
        if not writers:
            self.final = max(self.final, last_id)
        elif self.waiting is None:
            self.waiting = (last_id, writers)
        return self.final

    async def look(self, conn: Any, table: str) -> int:
        """``observe`` through an asyncpg connection (two statements, in this order)."""
        last_id = int(await conn.fetchval(_LAST_ID.format(table="$1"), table))
        writers = frozenset(await conn.fetchval(_WRITERS.format(table="$1"), table))
        return self.observe(last_id, writers)

    def look_sync(self, session: Any, table: str) -> int:
        """``observe`` through a SQLAlchemy session (two statements, in this order)."""
        last_id = int(session.execute(text(_LAST_ID.format(table=":table")), {"table": table}).scalar())
        writers = frozenset(session.execute(text(_WRITERS.format(table=":table")), {"table": table}).scalar())
        return self.observe(last_id, writers)
