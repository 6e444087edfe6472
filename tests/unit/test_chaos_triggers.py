"""The consume-once trigger of the chaos run (``tests/helpers/chaos_triggers.QueueTakeTrigger``): a
message it took is yielded however many cancels come while the take runs, as a handover sends its cancel
again with every answer until the coroutine has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.helpers import chaos_triggers


class TakingPool:
    """Stands for the source's pool: the first take hands the message out (it is gone at once)."""

    def __init__(self) -> None:
        self.taken = asyncio.Event()
        self.messages = ["the message"]

    async def fetchval(self, _sql: str, *_args: Any) -> str | None:
        await asyncio.sleep(0)
        if not self.messages:
            return None
        self.taken.set()
        return self.messages.pop()


@pytest.mark.parametrize("cancels", [1, 2, 5])
def test_a_taken_message_is_yielded_through_every_cancel(
    monkeypatch: pytest.MonkeyPatch, cancels: int
) -> None:
    pool = TakingPool()

    async def no_lookup(*_args: Any, **_kwargs: Any) -> Any:
        return pool

    monkeypatch.setattr(chaos_triggers, "target_for", no_lookup)
    monkeypatch.setattr(chaos_triggers, "shared_pool", no_lookup)

    async def scenario() -> list[dict[str, Any]]:
        trigger = chaos_triggers.QueueTakeTrigger("warehouse", "q00_1", poll_interval=0.01)
        events: list[dict[str, Any]] = []

        async def consume() -> None:
            async for event in trigger.run():
                events.append(event.payload)

        task = asyncio.create_task(consume())
        await pool.taken.wait()  # the message left the queue: the take is in its reply
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.CancelledError):
            await task
        return events

    assert asyncio.run(scenario()) == [{"key": "q00_1", "message": "the message"}]
    assert pool.messages == []
