"""Identity groups: the waiters (trigger rows) that share one identity and so one running coroutine.

Pure bookkeeping, no I/O. A group's *runner id* is the trigger row whose workload started its coroutine;
it stays the runner id for the coroutine's life even after that row's task leaves (leadership then passes
to another member without touching the coroutine). The *leader* is the member whose row would start the
next coroutine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triggers.identity import INTERVAL_KWARGS, merge_values


@dataclass
class Group:
    identity_hash: int
    members: set[int] = field(default_factory=set)
    runner_id: int | None = None  # trigger id of the running coroutine, None before it starts
    # execution settings merged over all members by their rules (the shortest poll interval, every
    # NOTIFY channel...), and those the running coroutine was started with
    settings: dict[str, Any] = field(default_factory=dict)
    rules: dict[str, str] = field(default_factory=dict)
    running_settings: dict[str, Any] = field(default_factory=dict)
    # members whose row cannot start a coroutine (task gone, workload not buildable): never the leader
    unstartable: set[int] = field(default_factory=set)
    # the execution kwargs of its first member, while every member so far brought the same ones (None
    # after one differed): a leader's own kwargs then hold the merged settings already
    uniform: Mapping[str, Sequence[Any]] | None = None
    _merged_any: bool = field(default=False, init=False, repr=False)

    @property
    def leader(self) -> int | None:
        """The oldest startable member (lowest trigger id): deterministic, usually the longest waiter."""
        candidates = self.members - self.unstartable
        return min(candidates) if candidates else None

    @property
    def empty(self) -> bool:
        return not self.members

    @property
    def poll_interval(self) -> float | None:
        """How often the group's coroutine polls (its members' shortest interval), when a kwarg says so."""
        return next(
            (
                float(v)
                for k in INTERVAL_KWARGS
                if isinstance(v := self.settings.get(k), int | float) and v > 0
            ),
            None,
        )

    def merge_settings(self, execution: Mapping[str, Sequence[Any]]) -> None:
        """Add one member's execution kwargs (``key -> (rule, value)``). A member that brings what every
        member before it brought changes nothing (each rule gives a value merged with itself back)."""
        if not self._merged_any:
            self._merged_any, self.uniform = True, execution
        elif self.uniform is not None:
            if execution == self.uniform:
                return
            self.uniform = None
        for key, (member_rule, value) in execution.items():
            rule = self.rules.setdefault(key, member_rule)
            current = [self.settings[key]] if key in self.settings else []
            self.settings[key] = merge_values(rule, [*current, value])

    def stricter_than_running(self) -> bool:
        """A member joined that needs more than the coroutine runs with (merges only ever grow)."""
        return self.runner_id is not None and any(
            key not in self.running_settings or self.running_settings[key] != value
            for key, value in self.settings.items()
        )


@dataclass
class Groups:
    """All groups of one instance, indexed by identity hash, member and runner id.

    Kept so that a loop in which nothing changed costs nothing per group: the groups waiting for a
    coroutine are indexed, the count of groups with members is kept, and ``version`` changes whenever
    the set of runner ids does (the supervisor asks the runner for coroutines only then). ``arrivals``
    changes whenever a group comes to wait for a coroutine or a waiting group gains a member (the
    supervisor's start order holds until then).
    """

    by_hash: dict[int, Group] = field(default_factory=dict)
    hash_of_member: dict[int, int] = field(default_factory=dict)
    hash_of_runner: dict[int, int] = field(default_factory=dict)
    # hash_of_runner's keys, kept: the supervisor compares them with the runner's coroutines once per batch
    # of a takeover, and copying tens of thousands of ids each time was a tenth of its CPU there
    runners: set[int] = field(default_factory=set)
    unstarted: dict[int, Group] = field(default_factory=dict)  # groups with members and no coroutine
    # groups whose coroutine failed and that start again at a time.monotonic(): identity hash -> time
    suspended: dict[int, float] = field(default_factory=dict)
    version: int = 0
    arrivals: int = 0
    _with_members: int = 0

    def join(
        self, trigger_id: int, identity_hash: int, execution: Mapping[str, Sequence[Any]] | None = None
    ) -> Group:
        group = self.by_hash.get(identity_hash)
        if group is None:
            group = self.by_hash[identity_hash] = Group(identity_hash)
        if group.empty:
            self._with_members += 1
        group.members.add(trigger_id)
        group.merge_settings(execution or {})
        self.hash_of_member[trigger_id] = identity_hash
        if group.runner_id is None and identity_hash not in self.suspended:
            self.unstarted[identity_hash] = group
            self.arrivals += 1
        return group

    def leave(self, trigger_id: int) -> Group | None:
        """Remove a member; the group (possibly now empty) is returned, still indexed by its runner."""
        identity_hash = self.hash_of_member.pop(trigger_id, None)
        if identity_hash is None:
            return None
        group = self.by_hash[identity_hash]
        group.members.discard(trigger_id)
        group.unstartable.discard(trigger_id)
        if group.empty:
            self._with_members -= 1
            self.unstarted.pop(identity_hash, None)
            self.suspended.pop(identity_hash, None)
        return group

    def start(self, group: Group, runner: int | None = None) -> int | None:
        """Record that a member's row (the leader's by default) now runs the group's coroutine; None
        when no member can start it."""
        runner = group.leader if runner is None else runner
        if runner is None:
            # no member can start it: parked until a member joins, so it never holds a start slot
            self.unstarted.pop(group.identity_hash, None)
            return None
        if runner not in group.members:
            raise ValueError(f"trigger {runner} is not a member of the group")
        group.runner_id = runner
        group.running_settings = dict(group.settings)
        self.hash_of_runner[runner] = group.identity_hash
        self.runners.add(runner)
        self.unstarted.pop(group.identity_hash, None)
        self.suspended.pop(group.identity_hash, None)
        self.version += 1
        return runner

    def restart(self, group: Group, runner: int) -> int | None:
        """Run the group from another member's row (its old coroutine is cancelled by the caller)."""
        self.stop_runner(group)
        return self.start(group, runner)

    def by_runner(self, runner_id: int) -> Group | None:
        identity_hash = self.hash_of_runner.get(runner_id)
        return None if identity_hash is None else self.by_hash.get(identity_hash)

    def finish(self, group: Group) -> None:
        """Forget a group whose coroutine ended (fired, failed, or was cancelled)."""
        if group.runner_id is not None:
            self.hash_of_runner.pop(group.runner_id, None)
            self.runners.discard(group.runner_id)
        for member in group.members:
            self.hash_of_member.pop(member, None)
        if self.by_hash.get(group.identity_hash) is group:
            del self.by_hash[group.identity_hash]
            if not group.empty:
                self._with_members -= 1
        self.unstarted.pop(group.identity_hash, None)
        self.suspended.pop(group.identity_hash, None)
        self.version += 1

    def stop_runner(self, group: Group) -> None:
        """The coroutine stopped but the group keeps waiting (e.g. it needs a restart)."""
        if self._drop_runner(group):
            self.unstarted[group.identity_hash] = group
            self.arrivals += 1

    def suspend(self, group: Group, until: float) -> None:
        """The coroutine failed: the group keeps its members but starts again only at ``until``."""
        self.unstarted.pop(group.identity_hash, None)
        if self._drop_runner(group):
            self.suspended[group.identity_hash] = until

    def _drop_runner(self, group: Group) -> bool:
        """Forget the group's coroutine; True when the group still waits (members, and still indexed)."""
        if group.runner_id is not None:
            self.hash_of_runner.pop(group.runner_id, None)
            self.runners.discard(group.runner_id)
        group.runner_id = None
        self.version += 1
        return not group.empty and self.by_hash.get(group.identity_hash) is group

    def wake(self, now: float) -> None:
        """Suspended groups whose time has come wait for a coroutine again."""
        for identity_hash, until in list(self.suspended.items()):
            if until <= now:
                del self.suspended[identity_hash]
                group = self.by_hash[identity_hash]
                if group.runner_id is None and not group.empty:
                    self.unstarted[identity_hash] = group
                    self.arrivals += 1

    def members(self) -> set[int]:
        return set(self.hash_of_member)

    def waiting(self) -> Iterable[Group]:
        return (g for g in self.by_hash.values() if not g.empty)

    def waiter_count(self) -> int:
        return len(self.hash_of_member)

    def group_count(self) -> int:
        """Groups with members (kept, not counted: this runs for every heartbeat and /metrics)."""
        return self._with_members

    def polls_saved_per_minute(self) -> float:
        """Polls a minute the members would make on their own and the shared coroutine does not (groups
        whose interval is known; a group of n saves n - 1 polls per interval)."""
        saved = 0.0
        for group in self.by_hash.values():
            if len(group.members) < 2:
                continue
            interval = group.poll_interval
            if interval:
                saved += (len(group.members) - 1) * 60 / interval
        return saved
