"""The wait loop every trigger of ours shares: check, back off on transient errors, stop on permanent ones.

A check returns the event payload when the wait is over, or ``None`` to keep waiting. Connection errors
and overloads back off with jitter (capped at the poll interval); errors in the check itself (bad SQL, an
unexpected 4xx, a bad URL) end the wait with ``{"status": "error", "message": ...}`` so the task fails
with the cause instead of waiting until its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack, asynccontextmanager
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


Channels = str | Sequence[str] | None


def channel_names(channels: Channels) -> list[str]:
    """``notify_channel`` as a sorted list of distinct names (a group listens on all its members')."""
    if channels is None or channels == "":
        return []
    names = [channels] if isinstance(channels, str) else list(channels)
    for name in names:
        if not isinstance(name, str) or not name.replace("_", "").isalnum():
            raise ValueError(f"notify_channel={name!r} is not a plain channel name (letters, digits, _)")
    return sorted(set(names))


def one_or_many(names: Sequence[str]) -> str | list[str] | None:
    """How a trigger keeps its channels: None, one name (as its author wrote it), or a group's list."""
    if not names:
        return None
    return names[0] if len(names) == 1 else list(names)


class Hint:
    """Optional LISTEN subscriptions: a NOTIFY on any of the channels wakes the wait early."""

    def __init__(self, listeners: Sequence[ChannelListener], event: asyncio.Event | None) -> None:
        self.listeners, self.event = list(listeners), event

    async def arm(self) -> None:
        """Before each check: reconnect dropped listeners, forget notifications already acted on. A
        listener that cannot connect now leaves the wait polling (``ensure`` never raises)."""
        if self.event is None:
            return
        for listener in self.listeners:
            await listener.ensure()
        self.event.clear()


@asynccontextmanager
async def listening(target: PgTarget | None, channels: Channels) -> AsyncIterator[Hint]:
    names = channel_names(channels)
    if target is None or not names:
        yield Hint([], None)
        return
    event = asyncio.Event()
    listeners = [shared_listener(target, name) for name in names]
    with ExitStack() as stack:
        for listener in listeners:
            stack.enter_context(listener.subscription(event))
        yield Hint(listeners, event)


async def poll_until(
    check: Check, *, poll_interval: float, log: Any, hint: Hint | None = None
) -> dict[str, Any]:
    hint = hint or Hint([], None)
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
