"""What the supervisor's parts share: the settings, the instance's identity (its job and the trigger rows
it serves), the identity groups and their members, the shards it owns, the database clock and the
counters the heartbeat publishes. Each part owns the rest of its state (its own attributes, set in its
``__init__``) and is handed this, and the calls it makes of other parts by name, when the conductor
(``SmartTriggerRunnerSupervisor``) builds it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import attrs
from airflow.triggers.base import TriggerEvent
from sqlalchemy.orm import Session

from smart_triggerer.config import Settings
from smart_triggerer.db.store import RowScope, Store, space_key
from smart_triggerer.placement.groups import Groups


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What the loop needs to know of a member (its row's other fields are not kept)."""

    shard: int
    has_task: bool
    dedupable: bool


@dataclass
class Held:
    """An event kept back for a member whose deferral is too recent to resume safely."""

    event: TriggerEvent
    release_at: float  # time.monotonic()


@attrs.define(kw_only=True)
class Counters:
    """Totals since start, published with each heartbeat."""

    events: int = 0
    resumed: int = 0
    failures: int = 0


@attrs.define(kw_only=True)
class Shared:
    settings: Settings
    capacity: int  # the most coroutines this instance runs ([triggerer] capacity, --capacity)
    job: Any = None  # its TriggererJob (the id is the instance's)
    queues: frozenset[str] | set[str] | None = None
    team_name: str | None = None
    multi_team: bool = False
    groups: Groups = attrs.field(factory=Groups)
    member_info: dict[int, MemberInfo] = attrs.field(factory=dict)
    # members whose deferral is too recent to resume them yet: trigger id -> time.monotonic() it ends
    young_until: dict[int, float] = attrs.field(factory=dict)
    # events kept back for members that deferred too recently (also stored: 0013_held_events.sql)
    held: dict[int, Held] = attrs.field(factory=dict)
    owned: set[int] = attrs.field(factory=set)
    # owned shards whose lease a write transaction found lapsed by the database clock: dropped after it
    lapsed: set[int] = attrs.field(factory=set)
    # coroutines whose cancel is a user's action (a lone task's trigger gets on_kill, as in stock Airflow)
    user_cancels: set[int] = attrs.field(factory=set)
    # the database clock's last reading (epoch seconds) and time.monotonic() then: between two renewals the
    # database's time is estimated from it, so a step of the database's clock is followed within a loop
    db_clock: tuple[float, float] | None = None
    counters: Counters = attrs.field(factory=Counters)

    @property
    def job_id(self) -> int:
        assert self.job is not None, "the smart triggerer always runs under a TriggererJob"
        return int(self.job.id)

    @property
    def queues_key(self) -> str | None:
        """This instance's shard space: its queue set, and its team (each team its own space, as each
        queue set)."""
        return space_key(self.queues, self.team_name)

    @property
    def queue_list(self) -> RowScope:
        """Which trigger rows it runs (Airflow's filters: queues, and the team with ``[core] multi_team``)."""
        return RowScope(tuple(sorted(self.queues)) if self.queues else None, self.team_name, self.multi_team)

    def fence(self, session: Session) -> set[int]:
        """The owned shards whose lease still holds, share-locked until this transaction ends. Owned shards
        whose lease lapsed by the database clock are dropped once the caller is done (the leases)."""
        if not self.owned:
            return set()
        fenced = Store(session).fence(self.job_id, self.owned, self.queues_key)
        self.lapsed |= self.owned - fenced
        return fenced

    def db_now(self) -> float:
        """The database clock now (epoch seconds), from its last reading and the host's monotonic clock."""
        if self.db_clock is None:
            return time.time()
        reading, at = self.db_clock
        return reading + (time.monotonic() - at)

    def shard_of(self, trigger_id: int) -> int | None:
        info = self.member_info.get(trigger_id)
        return None if info is None else info.shard

    def forget_member(self, trigger_id: int, *, user_action: bool) -> None:
        info = self.member_info.pop(trigger_id, None)
        self.young_until.pop(trigger_id, None)
        group = self.groups.leave(trigger_id)
        if group is None or not group.empty:
            return
        # A lone task's trigger left by user action gets on_kill, as in stock Airflow;
        # a shared coroutine never does (its other waiters may still need it).
        lone_task = info is not None and not info.dedupable and info.has_task
        if group.runner_id is not None and user_action and lone_task:
            self.user_cancels.add(group.runner_id)
        self.groups.finish(group)

    def is_task(self, trigger_id: int) -> bool:
        info = self.member_info.get(trigger_id)
        return info is None or info.has_task

    def task_members(self, members: Iterable[int]) -> list[int]:
        return [m for m in members if self.is_task(m)]

    def room(self) -> int:
        """Coroutines this instance may still start: capacity is a cap, as in Airflow's triggerer, also
        when the whole fleet is full (then the rest wait, deferred, most urgent first, for room)."""
        return max(0, self.capacity - len(self.groups.runners))

    def waiting_for_room(self) -> int:
        """Groups held but not run: the instance is at its capacity."""
        return len(self.groups.unstarted) if self.room() == 0 else 0

    def busy_budget(self) -> float:
        """Seconds one call may spend starting groups or hashing rows before the loop goes on."""
        return max(0.25, self.settings.lease_seconds * 0.1)
