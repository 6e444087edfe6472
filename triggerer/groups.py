"""Identity groups: the waiters (trigger rows) that share one identity and so one running coroutine.

Pure bookkeeping, no I/O. A group's *runner id* is the trigger row whose workload started its coroutine;
it stays the runner id for the coroutine's life even after that row's task leaves (leadership then passes
to another member without touching the coroutine). The *leader* is the member whose row would start the
next coroutine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class Group:
    identity_hash: int
    members: set[int] = field(default_factory=set)
    runner_id: int | None = None  # trigger id of the running coroutine, None before it starts
    # numeric execution settings (poll intervals...): the most demanding (smallest) of all members,
    # and those the running coroutine was started with
    settings: dict[str, float] = field(default_factory=dict)
    running_settings: dict[str, float] = field(default_factory=dict)

    @property
    def leader(self) -> int | None:
        """The oldest member (lowest trigger id): deterministic, and usually the longest waiter."""
        return min(self.members) if self.members else None

    @property
    def empty(self) -> bool:
        return not self.members

    def merge_settings(self, execution: Mapping[str, float]) -> None:
        for key, value in execution.items():
            self.settings[key] = min(value, self.settings.get(key, value))

    def stricter_than_running(self) -> bool:
        """A member joined that needs a more demanding setting than the coroutine runs with."""
        return self.runner_id is not None and any(
            value < self.running_settings.get(key, math.inf) for key, value in self.settings.items()
        )


@dataclass
class Groups:
    """All groups of one instance, indexed by identity hash, member and runner id."""

    by_hash: dict[int, Group] = field(default_factory=dict)
    hash_of_member: dict[int, int] = field(default_factory=dict)
    hash_of_runner: dict[int, int] = field(default_factory=dict)

    def join(self, trigger_id: int, identity_hash: int,
             execution: Mapping[str, float] | None = None) -> Group:
        group = self.by_hash.get(identity_hash)
        if group is None:
            group = self.by_hash[identity_hash] = Group(identity_hash)
        group.members.add(trigger_id)
        group.merge_settings(execution or {})
        self.hash_of_member[trigger_id] = identity_hash
        return group

    def leave(self, trigger_id: int) -> Group | None:
        """Remove a member; the group (possibly now empty) is returned, still indexed by its runner."""
        identity_hash = self.hash_of_member.pop(trigger_id, None)
        if identity_hash is None:
            return None
        group = self.by_hash[identity_hash]
        group.members.discard(trigger_id)
        return group

    def start(self, group: Group, runner: int | None = None) -> int:
        """Record that a member's row (the leader's by default) now runs the group's coroutine."""
        runner = group.leader if runner is None else runner
        if runner is None:
            raise ValueError("cannot start an empty group")
        if runner not in group.members:
            raise ValueError(f"trigger {runner} is not a member of the group")
        group.runner_id = runner
        group.running_settings = dict(group.settings)
        self.hash_of_runner[runner] = group.identity_hash
        return runner

    def restart(self, group: Group, runner: int) -> int:
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
        for member in group.members:
            self.hash_of_member.pop(member, None)
        self.by_hash.pop(group.identity_hash, None)

    def stop_runner(self, group: Group) -> None:
        """The coroutine stopped but the group keeps waiting (e.g. it needs a restart)."""
        if group.runner_id is not None:
            self.hash_of_runner.pop(group.runner_id, None)
        group.runner_id = None

    def members(self) -> set[int]:
        return set(self.hash_of_member)

    def runner_ids(self) -> set[int]:
        return set(self.hash_of_runner)

    def waiting(self) -> Iterable[Group]:
        return (g for g in self.by_hash.values() if not g.empty)

    def waiter_count(self) -> int:
        return len(self.hash_of_member)

    def group_count(self) -> int:
        return sum(1 for _ in self.waiting())
