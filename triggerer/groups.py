"""Identity groups: the waiters (trigger rows) that share one identity and so one running coroutine.

Pure bookkeeping, no I/O. A group's *runner id* is the trigger row whose workload started its coroutine;
it stays the runner id for the coroutine's life even after that row's task leaves (leadership then passes
to another member without touching the coroutine). The *leader* is the member whose row would start the
next coroutine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Group:
    identity_hash: int
    members: set[int] = field(default_factory=set)
    runner_id: int | None = None  # trigger id of the running coroutine, None before it starts

    @property
    def leader(self) -> int | None:
        """The oldest member (lowest trigger id): deterministic, and usually the longest waiter."""
        return min(self.members) if self.members else None

    @property
    def empty(self) -> bool:
        return not self.members


@dataclass
class Groups:
    """All groups of one instance, indexed by identity hash, member and runner id."""

    by_hash: dict[int, Group] = field(default_factory=dict)
    hash_of_member: dict[int, int] = field(default_factory=dict)
    hash_of_runner: dict[int, int] = field(default_factory=dict)

    def join(self, trigger_id: int, identity_hash: int) -> Group:
        group = self.by_hash.get(identity_hash)
        if group is None:
            group = self.by_hash[identity_hash] = Group(identity_hash)
        group.members.add(trigger_id)
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

    def start(self, group: Group) -> int:
        """Record that the leader's row now runs the group's coroutine; returns the runner id."""
        leader = group.leader
        if leader is None:
            raise ValueError("cannot start an empty group")
        group.runner_id = leader
        self.hash_of_runner[leader] = group.identity_hash
        return leader

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
