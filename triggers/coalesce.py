"""Coalesced checks: the waits of one process on the same source share one query per tick.

Deduplication makes one poll per *distinct* wait; a status table waited on for 10,000 different tables
still answers 10,000 queries per interval. A :class:`KeyedBatch` answers them all with one statement over
the union of their keys (``WHERE key = ANY($1)``, chunked at :data:`CHUNK_KEYS`), and hands each member
the rows of its own keys: the member judges them itself (its own ``since``, FAILED, soft_fail, timeout).

The contract for a trigger that can coalesce (see docs/design.md, "Coalesced checks"):

- its check is one read of rows, each row belongs to one key, the keys of one wait are known up front;
- the statement takes the key list as its only parameter and is the same for every member of the batch
  (the batch key holds the connection and the statement; never the keys);
- a member's verdict depends only on the rows of its own keys.

Cadence: the batch runs a full tick at the shortest poll interval of its members (a member with a longer
interval is checked that often too, at no extra query); a new member is checked in a join tick
:data:`JOIN_DELAY` after it joins, together with every other member that joined meanwhile; a NOTIFY on any
member's channel runs a full tick at once. A connection error backs the whole batch off (with jitter, capped
at the interval) and its members keep waiting; an error in the statement itself ends every member it
answers, with the cause; an error that only some keys cause (a value the source refuses) is found by
splitting the keys and ends only the members that hold them. Each batch is a task of its own, so a slow
source delays no other source's batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from triggers.pg import ChannelListener, backoff_seconds, is_permanent

log = structlog.get_logger(__name__)

CHUNK_KEYS = 5000  # keys per statement: a 10,000-key tick is two statements
JOIN_DELAY = 0.05  # seconds a join tick waits for more members (a takeover starts thousands at once)

# keys -> rows; each row's key is read with the batch's ``key_of``
Fetch = Callable[[Sequence[str]], Awaitable[Sequence[Any]]]


@dataclass(frozen=True)
class Answer:
    """What one tick found for one member: its keys' rows, or the error that ends its wait."""

    rows: tuple[Any, ...] = ()
    error: str | None = None


@dataclass(eq=False)
class Member:
    """One wait in a batch; its trigger awaits :meth:`next` and judges each answer itself."""

    keys: tuple[str, ...]
    interval: float
    channels: tuple[str, ...] = ()
    checked: bool = False
    _answer: Answer | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def deliver(self, answer: Answer) -> None:
        self._answer = answer
        self._ready.set()

    async def next(self) -> Answer:
        """The next tick's answer for this member."""
        await self._ready.wait()
        self._ready.clear()
        answer, self._answer = self._answer, None
        assert answer is not None
        return answer


@dataclass
class BatchStats:
    """Counts of one batch, and of every batch of the process (:data:`totals`)."""

    ticks: int = 0
    statements: int = 0  # sent to the source
    answered: int = 0  # of those, the ones that returned rows
    keys: int = 0
    splits: int = 0
    failed: int = 0  # ticks the source did not answer (backed off)

    def add(self, **counts: int) -> None:
        for name, count in counts.items():
            setattr(self, name, getattr(self, name) + count)
            setattr(totals, name, getattr(totals, name) + count)


totals = BatchStats()  # every batch of this process, ended ones included


class KeyedBatch:
    """All members on one (source, statement) in one event loop, and the task that checks them."""

    def __init__(
        self,
        name: str,
        fetch: Fetch,
        key_of: Callable[[Any], str],
        listener: Callable[[str], ChannelListener] | None = None,
        chunk: int | None = None,
    ) -> None:
        self.name, self.fetch, self.key_of = name, fetch, key_of
        self.chunk = chunk or CHUNK_KEYS
        self.listener = listener
        self.members: set[Member] = set()
        self.stats = BatchStats()
        self.wake = asyncio.Event()  # a join, a leave that changes the cadence, or a NOTIFY
        self.full_due = False  # a NOTIFY asked for a full tick
        self.task: asyncio.Task[None] | None = None
        self.on_empty: Callable[[], None] | None = None
        self._subscriptions: dict[str, contextlib.ExitStack] = {}
        self._channel_users: dict[str, int] = {}
        self._statement_works: bool | None = None  # per tick: does the statement run with no keys?

    # --- membership ---

    @contextlib.asynccontextmanager
    async def join(
        self, keys: Iterable[str], interval: float, channels: Sequence[str] = ()
    ) -> AsyncIterator[Member]:
        member = Member(tuple(sorted(set(keys))), float(interval), tuple(channels))
        self.members.add(member)
        self._subscribe(member.channels)
        self.wake.set()
        if self.task is None or self.task.done():
            self._start()
        try:
            yield member
        finally:
            self.members.discard(member)
            self._unsubscribe(member.channels)
            self.wake.set()
            if not self.members:
                self._end()

    def _end(self) -> None:
        """No member left: forget the batch now (a wait that comes next starts a new one) and stop its
        statement in flight, which nobody waits for."""
        if self.on_empty is not None:
            self.on_empty()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            self.task = None

    def _subscribe(self, channels: Sequence[str]) -> None:
        if self.listener is None:
            return
        for channel in channels:
            self._channel_users[channel] = self._channel_users.get(channel, 0) + 1
            if channel not in self._subscriptions:
                stack = contextlib.ExitStack()
                stack.enter_context(self.listener(channel).subscription(_NotifyEvent(self)))
                self._subscriptions[channel] = stack

    def _unsubscribe(self, channels: Sequence[str]) -> None:
        for channel in channels:
            users = self._channel_users.get(channel, 0) - 1
            if users > 0:
                self._channel_users[channel] = users
                continue
            self._channel_users.pop(channel, None)
            stack = self._subscriptions.pop(channel, None)
            if stack is not None:
                stack.close()

    def notified(self) -> None:
        self.full_due = True
        self.wake.set()

    # --- the loop ---

    def interval(self) -> float:
        return min((m.interval for m in self.members), default=60.0)

    async def _run(self) -> None:
        failures = 0
        last_full = float("-inf")  # the first tick checks everyone
        retry_at = float("-inf")  # after a failed tick: no tick before this, whatever joins or leaves
        while self.members:
            # cleared before deciding, never while sleeping: a NOTIFY or a join during a tick wakes the
            # sleep that follows it
            self.wake.clear()
            now = time.monotonic()
            if now < retry_at:
                await self._sleep(retry_at - now, gather_joins=False)
                continue
            # a member with a shorter interval shortens the cadence from its join on
            full = self.full_due or now >= last_full + self.interval()
            due = list(self.members) if full else [m for m in self.members if not m.checked]
            if due:
                self.full_due = False
                try:
                    await self._arm_listeners()
                    await self._tick(due)
                except Exception as err:  # not a statement error (those are answered): the source is away
                    failures += 1
                    self.stats.add(failed=1)
                    # the retry owes what this tick was for: a NOTIFY's full tick stays due (a scheduled
                    # one stays due by ``last_full``), or its rows would wait for the next interval
                    self.full_due = self.full_due or full
                    log.warning(
                        "source unreachable; backing off",
                        batch=self.name,
                        members=len(due),
                        error=type(err).__name__,
                        attempt=failures,
                    )
                    retry_at = time.monotonic() + backoff_seconds(failures, cap=self.interval())
                    continue
                failures = 0
                if full:
                    last_full = time.monotonic()
            await self._sleep(max(0.0, last_full + self.interval() - time.monotonic()))
        self._end()  # no await since the loop's check: a member that joins now starts a new batch

    async def _sleep(self, seconds: float, *, gather_joins: bool = True) -> None:
        """Up to ``seconds``; a join (after JOIN_DELAY, to gather its neighbours), a leave or a NOTIFY
        ends it early, also one that came since the loop's last decision."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)
        if gather_joins and any(not m.checked for m in self.members) and not self.full_due:
            await asyncio.sleep(JOIN_DELAY)

    async def _arm_listeners(self) -> None:
        """Reconnect dropped listeners before a tick, so that a NOTIFY sent during the tick is not lost. A
        listener is only a hint (polling stays the truth): one that cannot connect now is tried again
        before the next tick."""
        if self.listener is None:
            return
        for channel in list(self._subscriptions):
            try:
                await self.listener(channel).ensure()
            except Exception as err:
                log.warning(
                    "cannot listen on the source; polling only", batch=self.name, error=type(err).__name__
                )

    def _started(self, task: asyncio.Task[None]) -> None:
        """A batch task that ended other than by its own loop or a cancel (a bug) is logged, and started
        again while members wait on it: they would otherwise wait for good."""
        if task.cancelled() or task.exception() is None:
            return
        log.error(
            "coalesced check stopped; starting it again",
            batch=self.name,
            error=type(task.exception()).__name__,
            exc_info=task.exception(),
        )
        if self.task is task:
            self.task = None
            asyncio.get_running_loop().call_later(1.0, self._restart)

    def _restart(self) -> None:
        if self.members and self.task is None:
            self._start()

    def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"batch {self.name}")
        self.task.add_done_callback(self._started)

    async def _tick(self, due: list[Member]) -> None:
        keys = sorted({key for member in due for key in member.keys})
        self.stats.add(ticks=1)
        self._statement_works = None
        found: dict[str, list[Any]] = {}
        refused: dict[str, str] = {}
        for start in range(0, len(keys), self.chunk):
            await self._fetch_isolating(keys[start : start + self.chunk], found, refused)
        for member in due:
            if member not in self.members:
                continue  # left during the tick
            member.checked = True
            bad = next((refused[k] for k in member.keys if k in refused), None)
            if bad is not None:
                member.deliver(Answer(error=bad))
            else:
                member.deliver(Answer(rows=tuple(row for key in member.keys for row in found.get(key, ()))))

    async def _fetch_isolating(
        self, keys: list[str], found: dict[str, list[Any]], refused: dict[str, str]
    ) -> None:
        """Rows of ``keys`` into ``found``; a statement error that some keys cause is narrowed down by
        halving the keys, and each key that fails alone goes into ``refused`` with the cause."""
        try:
            rows = await self._fetch(keys)
        except Exception as err:
            if not is_permanent(err):
                raise
            cause = f"{type(err).__name__}: {err}"
            if len(keys) == 1 or not await self._keys_matter():
                refused.update(dict.fromkeys(keys, cause))
                return
            self.stats.add(splits=1)
            middle = len(keys) // 2
            await self._fetch_isolating(keys[:middle], found, refused)
            await self._fetch_isolating(keys[middle:], found, refused)
            return
        for row in rows:
            found.setdefault(self.key_of(row), []).append(row)

    async def _fetch(self, keys: Sequence[str]) -> Sequence[Any]:
        self.stats.add(statements=1, keys=len(keys))
        rows = await self.fetch(keys)
        self.stats.add(answered=1)
        return rows

    async def _keys_matter(self) -> bool:
        """Does the statement work with no keys at all (asked once a tick)? If not, the statement itself
        is wrong and every key would fail: no point in splitting."""
        if self._statement_works is None:
            try:
                await self._fetch([])
                self._statement_works = True
            except Exception as err:
                if not is_permanent(err):
                    raise
                self._statement_works = False
        return self._statement_works


class _NotifyEvent(asyncio.Event):
    """What a channel listener sets: here, a full tick of the batch."""

    def __init__(self, batch: KeyedBatch) -> None:
        super().__init__()
        self.batch = batch

    def set(self) -> None:
        self.batch.notified()


def coalescing() -> bool:
    """``[smart_triggerer] coalesce_checks`` (default on): read where the trigger runs."""
    from airflow.configuration import conf

    return conf.getboolean("smart_triggerer", "coalesce_checks", fallback=True)


_batches: dict[tuple[Hashable, int], KeyedBatch] = {}


def shared_batch(key: Hashable, make: Callable[[], KeyedBatch]) -> KeyedBatch:
    """The running loop's batch for ``key`` (a source and a statement), made on first use."""
    full_key = (key, id(asyncio.get_running_loop()))
    batch = _batches.get(full_key)
    if batch is None:
        batch = make()
        batch.on_empty = lambda: _forget(full_key, batch)
        _batches[full_key] = batch
    return batch


def _forget(full_key: tuple[Hashable, int], batch: KeyedBatch) -> None:
    if _batches.get(full_key) is batch:
        del _batches[full_key]


def batches() -> Mapping[tuple[Hashable, int], KeyedBatch]:
    return _batches
