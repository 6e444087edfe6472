"""Shard placement that follows load: filters, then consistent hashing with bounded loads.

Every live instance computes the same map from the same inputs, read in its lease renewal's transaction:
the members (capacity, whether they take new shards, the load they ask to come down to), each shard's
current owner and the groups (coroutines) it holds. The rules, in this order for each shard by number:

1. **Filters.** A member that does not accept new shards (its event loop lags, its memory is over the
   limit: ``supervisor/load.py``) may keep shards it owns, never receive one; a member that asks to come
   down to ``limit`` groups holds no more than that; no member holds more groups than its ``capacity``.
2. **Stay.** A shard stays with its owner while the owner's load, with the shard, is within the owner's
   fair share plus half an average shard (the share: ``load(total) * capacity / total capacity``; a
   member asked to hold less gets at most that, and what it gives up is shared among the others:
   ``fair_shares``). So a join moves what the others hold above their new share, and a leave only the
   leaver's shards.
3. **Comparators.** Otherwise, under the fair shares: a shard its live owner cannot keep goes to the
   member furthest below its share (on a join, the joiner), a shard without a live owner to the member
   with the least room it fits in (ties in the shard's rendezvous order, ``rendezvous.py``: weighted by
   capacity, stable); failing that, to the first member in rendezvous order with room under
   ``(1 + epsilon)`` times its share (bounded loads: no member above that while any has room).
4. **Over the bound.** A shard too heavy for every bound goes to the member with the most room under its
   cap (not full: the bound is a spread goal, the cap a limit).
5. **Full.** When no member has room under its cap, the shard stays with its owner, or goes to the member
   with the most room left, and the placement says it is full: a wait is never left without an instance.

A shard weighs its groups, and at least 1 (so that empty shards still spread by count). The result is a
fixed point: computed again with the owners it gives, it gives the same map, so shards do not flap while
the inputs hold still.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from smart_triggerer.placement.rendezvous import Member, score


@dataclass(frozen=True)
class Candidate:
    """A live instance as placement sees it."""

    job_id: int
    capacity: int
    accepting: bool = True  # takes new shards (filters passed)
    limit: int | None = None  # groups it asks to come down to while shedding

    @property
    def cap(self) -> int:
        """Groups this member may hold at most."""
        return self.capacity if self.limit is None else min(self.capacity, self.limit)


@dataclass
class Placement:
    owners: dict[int, int]  # shard -> job id
    full: bool = False  # some shard found no member with room (the fleet is full)
    groups: dict[int, int] = field(default_factory=dict)  # job id -> groups placed on it

    def shards_of(self, job_id: int) -> set[int]:
        return {shard for shard, owner in self.owners.items() if owner == job_id}


@dataclass
class _Room:
    member: Candidate
    share: float  # fair share of the total weight (fair_shares)
    bound: float  # (1 + epsilon) * share, at most the member's cap (_bound)
    weight: float = 0.0
    groups: int = 0

    def fits(self, weight: float, groups: int, most: float) -> bool:
        """Room for a shard under ``most`` (weight) and under the member's cap (groups)."""
        return self.weight + weight <= most + 1e-9 and self.groups + groups <= self.member.cap

    def room(self) -> tuple[float, float]:
        return (self.member.cap - self.groups, self.bound - self.weight)


# rounds of the placement computed on its own result until it no longer changes (see ``place``)
SETTLE_ROUNDS = 8


def place(
    shards: int,
    members: Iterable[Candidate],
    groups: Mapping[int, int],
    owners: Mapping[int, int | None],
    epsilon: float,
) -> Placement:
    """shard -> owner for every shard of ``range(shards)``; ``groups``: groups per shard as published
    (missing: not known yet, see ``_with_estimates``);
    ``owners``: each shard's current owner (None or a non-member: none).

    One round keeps what fits its owner in shard order, so a shard a member receives can displace one of
    its own with a higher number in the next round. The rounds run here, on paper, until the map no longer
    changes: every instance reaches the same map from the same inputs, and the instances move each shard
    once, to where it stays."""
    live = sorted(members, key=lambda m: m.job_id)
    if not live:
        return Placement({})
    groups = _with_estimates(shards, groups)
    result = _place_once(shards, live, groups, owners, epsilon)
    for _ in range(SETTLE_ROUNDS):
        again = _place_once(shards, live, groups, result.owners, epsilon)
        if again.owners == result.owners:
            break
        result = again
    return result


def _with_estimates(shards: int, known: Mapping[int, int]) -> dict[int, int]:
    """Groups per shard, a shard no owner has published yet counted as the mean of those published: at a
    start, shards count as equals until loaded, not as empty (a shard that was empty until its owner loaded
    it would otherwise move away from an owner that just loaded it, and keep moving while the rest load)."""
    estimate = round(sum(known.values()) / len(known)) if known else 0
    return {shard: known.get(shard, estimate) for shard in range(shards)}


def _place_once(
    shards: int,
    live: list[Candidate],
    groups: Mapping[int, int],
    owners: Mapping[int, int | None],
    epsilon: float,
) -> Placement:
    weights = {shard: float(max(groups.get(shard, 0), 1)) for shard in range(shards)}
    shares = fair_shares(sum(weights.values()), live)
    rooms = {m.job_id: _Room(m, shares[m.job_id], _bound(m, shares[m.job_id], epsilon)) for m in live}
    result = Placement({})
    placed: dict[int, tuple[_Room, bool]] = {}
    # an owner keeps up to half a shard over its share: a count that moves a little (groups come and go,
    # a shard's estimate replaced by its count) does not pass the last shard of a share back and forth
    margin = sum(weights.values()) / max(shards, 1) / 2
    for shard in range(shards):  # stays first, so that what the others keep is counted before a move
        owner = owners.get(shard)
        if owner in rooms and rooms[owner].fits(
            weights[shard], groups.get(shard, 0), rooms[owner].share + margin
        ):
            placed[shard] = _take(rooms[owner], weights[shard], groups.get(shard, 0)), False
    for shard in range(shards):
        if shard not in placed:
            owner = owners.get(shard)
            room, full = _choose(
                shard,
                weights[shard],
                groups.get(shard, 0),
                rooms=rooms,
                live=live,
                owner=owner if owner in rooms else None,
            )
            placed[shard] = _take(room, weights[shard], groups.get(shard, 0)), full
    result.owners = {shard: room.member.job_id for shard, (room, _) in sorted(placed.items())}
    result.full = any(full for _, full in placed.values())
    result.groups = {job_id: room.groups for job_id, room in rooms.items()}
    return result


def fair_shares(total: float, live: list[Candidate]) -> dict[int, float]:
    """Each member's fair share of ``total``: by capacity, except that a member asked to hold less (its
    ``cap``: capacity, or the limit it sheds to) gets at most that, and the rest is shared among the
    others by their capacities (water-filling), so that what a shedding member gives up has a place."""
    shares: dict[int, float] = {}
    open_members = list(live)
    left = total
    while open_members:
        capacity = sum(max(m.capacity, 1) for m in open_members)
        capped = [m for m in open_members if m.cap < left * max(m.capacity, 1) / capacity]
        if not capped:
            shares |= {m.job_id: left * max(m.capacity, 1) / capacity for m in open_members}
            break
        for member in capped:
            shares[member.job_id] = float(member.cap)
            left -= member.cap
        left = max(left, 0.0)
        open_members = [m for m in open_members if m.job_id not in shares]
    return shares


def _bound(member: Candidate, share: float, epsilon: float) -> float:
    """The most weight a member takes while another has room: (1 + epsilon) times its share, but never
    above what it was asked to hold (its cap)."""
    return min((1 + epsilon) * share, max(share, float(member.cap)))


def _take(room: _Room, weight: float, groups: int) -> _Room:
    room.weight += weight
    room.groups += groups
    return room


def _choose(
    shard: int,
    weight: float,
    groups: int,
    *,
    rooms: dict[int, _Room],
    live: list[Candidate],
    owner: int | None,
) -> tuple[_Room, bool]:
    """The member for one shard, and whether it was placed over every bound (full)."""
    allowed = [rooms[m.job_id] for m in _preference(shard, live) if m.accepting or m.job_id == owner]
    # under the shares: a shard its live owner cannot keep goes to the member furthest below its share
    # (on a join, the joiner, not another member that happens to have a little room); a shard without an
    # owner (a leaver's, a dead instance's, a start's) to the member with the least room it fits in, so
    # that the heavy shards still find room under a share and no member ends over its share and sheds
    # one of its own in the next loop. The rendezvous order breaks ties (sorted is stable).
    order = (
        sorted(allowed, key=lambda r: r.weight - r.share)
        if owner is not None
        else sorted(allowed, key=lambda r: r.share - r.weight)
    )
    for room in order:
        if room.fits(weight, groups, room.share):
            return room, False
    for room in allowed:
        if room.fits(weight, groups, room.bound):
            return room, False
    # over every bound but within a cap (a shard heavier than the bounds leave room for): not full
    within_cap = [room for room in allowed if room.groups + groups <= room.member.cap]
    if within_cap:
        return max(within_cap, key=lambda r: (r.room(), -r.member.job_id)), False
    if owner is not None:
        return rooms[owner], True  # the fleet is full: it keeps what it runs
    candidates = allowed or list(rooms.values())
    return max(candidates, key=lambda r: (r.room(), -r.member.job_id)), True


def _preference(shard: int, live: list[Candidate]) -> list[Candidate]:
    """Members in the shard's rendezvous order (highest weighted score first, lower job id on a tie)."""
    by_id = {m.job_id: m for m in live}
    return [by_id[job_id] for job_id in _ranked(shard, tuple((m.job_id, m.capacity) for m in live))]


@lru_cache(maxsize=1 << 16)
def _ranked(shard: int, members: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Cached: the placement runs every loop on the same few members (a SHA-256 per shard and member)."""
    ranked = sorted(members, key=lambda m: (-score(shard, Member(*m)), m[0]))
    return tuple(job_id for job_id, _ in ranked)


def moved(before: Mapping[int, int | None], after: Mapping[int, int]) -> int:
    """Shards whose owner changed (a shard without an owner before counts as moved)."""
    return sum(1 for shard, owner in after.items() if before.get(shard) != owner)
