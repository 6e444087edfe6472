"""A waiter row as the supervisor reads it (smart_triggerer/db/store.py): execution kwargs parsed once per
text."""

from __future__ import annotations

import json

from smart_triggerer.db.store import _parsed_execution, _waiting

ROW = (7, 123456789, 3, True, json.dumps({"poll_interval": ["min", 30]}), None, 0.0, True, None, None, None)


def test_a_row_becomes_a_waiting_trigger_with_its_execution_kwargs() -> None:
    waiting = _waiting(ROW)
    assert (
        waiting.trigger_id,
        waiting.identity_hash,
        waiting.shard,
        waiting.dedupable,
        waiting.has_task,
    ) == (7, 123456789, 3, True, True)
    assert waiting.execution == {"poll_interval": ["min", 30]}
    assert waiting.hold_left == 0.0 and waiting.error is None and waiting.timeout_in is None
    assert waiting.held_event is None
    unread = _waiting((8, 1, 0, False, None, "could not read", 1, False, 5, None, None))
    assert unread.execution == {} and unread.error == "could not read" and unread.timeout_in == 5.0
    held = _waiting((9, 1, 0, False, None, None, 0, True, None, '{"payload":1}', 2.5))
    assert held.held_event == '{"payload":1}' and held.held_in == 2.5


def test_the_same_text_is_parsed_once_and_each_row_gets_its_own_dict() -> None:
    _parsed_execution.cache_clear()
    first, second = _waiting(ROW), _waiting(ROW)
    assert first.execution == second.execution and first.execution is not second.execution
    assert _parsed_execution.cache_info().misses == 1
    first.execution["poll_interval"] = ["min", 5]  # one member's dict changed: the next row's is not
    assert _waiting(ROW).execution == {"poll_interval": ["min", 30]}
