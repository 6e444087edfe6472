"""Asset-watcher events that cannot be stored, counted per event and set aside after ``DEAD_AFTER`` tries.

A watcher whose event the database refuses (or whose listeners raise on it) is started again with backoff;
a source that replays events it was not told were stored (a status table's watermark in ack mode) then
hands out the same event for ever, and its later rows never become events. After ``DEAD_AFTER`` failures
of the same event in a row (about two minutes of backoff) the event is written to
``smart_triggerer.dead_event`` with its cause and acknowledged, so the source moves on. Task members are
never set aside: their failure is final at the first try.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from smart_triggerer.db.errors import storable

DEAD_AFTER = 8  # tries of one event: backoff 1 + 2 + 4 + ... + 60 s, about two minutes


def payload_text(payload: Any) -> str:
    """The event as JSON text that PostgreSQL's text type holds (no NUL, no lone surrogate)."""
    return storable(json.dumps(payload, sort_keys=True, default=str))


def _digest(payload: Any) -> str:
    return hashlib.sha256(
        json.dumps(payload, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
    ).hexdigest()


class DeadLetters:
    """Failures in a row of each (group, event); forgotten when the group stores an event."""

    def __init__(self) -> None:
        self.tries: dict[tuple[int, str], int] = {}
        self.total = 0

    def failed(self, identity_hash: int, payload: Any) -> int:
        """Count one more failure of this event of this group; returns the failures so far."""
        key = (identity_hash, _digest(payload))
        self.tries[key] = self.tries.get(key, 0) + 1
        return self.tries[key]

    def forget(self, identity_hash: int) -> None:
        for key in [k for k in self.tries if k[0] == identity_hash]:
            del self.tries[key]
