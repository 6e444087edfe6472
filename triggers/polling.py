"""The wait loop every trigger of ours shares: check, back off on transient errors, stop on permanent ones.

A check returns the event payload when the wait is over, or ``None`` to keep waiting. Connection errors
and overloads back off with jitter (capped at the poll interval); errors in the check itself (bad SQL, an
unexpected 4xx, a bad URL) end the wait with ``{"status": "error", "message": ...}`` so the task fails
with the cause instead of waiting until its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from triggers.pg import (
    ChannelListener,
    PgTarget,
    backoff_seconds,
    is_permanent,
    shared_listener,
    wait_or_hint,
)

Check = Callable[[], Awaitable[dict[str, Any] | None]]


class Hint:
    """An optional LISTEN subscription: a NOTIFY wakes the wait early."""

    def __init__(self, listener: ChannelListener | None, event: asyncio.Event | None) -> None:
        self.listener, self.event = listener, event

    async def arm(self) -> None:
        """Before each check: reconnect a dropped listener, forget notifications already acted on."""
        if self.listener is not None and self.event is not None:
            await self.listener.ensure()
            self.event.clear()


@asynccontextmanager
async def listening(target: PgTarget | None, channel: str | None) -> AsyncIterator[Hint]:
    if target is None or not channel:
        yield Hint(None, None)
        return
    listener = shared_listener(target, channel)
    with listener.subscription() as event:
        yield Hint(listener, event)


async def poll_until(
    check: Check, *, poll_interval: float, log: Any, hint: Hint | None = None
) -> dict[str, Any]:
    hint = hint or Hint(None, None)
    failures = 0
    while True:
        await hint.arm()
        try:
            payload = await check()
        except Exception as err:
            if is_permanent(err):
                return {"status": "error", "message": f"{type(err).__name__}: {err}"}
            failures += 1
            log.warning("source unreachable; backing off", error=type(err).__name__, attempt=failures)
            await asyncio.sleep(backoff_seconds(failures, cap=poll_interval))
            continue
        failures = 0
        if payload is not None:
            return payload
        await wait_or_hint(hint.event, poll_interval)
