"""The workload and the fault schedule: everything random is drawn here, from a seeded
random.Random, before anything runs."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.helpers.chaos.constants import (
    CONSUME,
    FLAG,
    FLAG_CHANNEL,
    FLAG_SQL,
    HTTP,
    LOAD_CHANNEL,
    POISON,
    POISON_MEMBERS,
    STATUS_TABLE,
    TABLE,
    TEAM,
    team_of,
)


@dataclass(frozen=True)
class Profile:
    """How big and how long; the seed makes the workload and the fault schedule reproducible."""

    seed: int
    minutes: float = 20.0
    waiters: int = 2000
    instances: int = 3
    duplicates: float = 0.4
    assets: int = 8
    timeout_share: float = 0.06
    wave_share: float = 0.25  # waiters seeded mid-run, while faults happen
    shards: int = 16
    lease_seconds: float = 6.0
    polls: tuple[float, ...] = (2.0, 3.0, 5.0)
    push_poll: float = 10.0  # push waiters poll rarely: NOTIFY wakes them
    asset_poll: float = 3.0
    gap: tuple[float, float] = (3.0, 8.0)  # quiet time between two faults
    row_every: tuple[float, float] = (0.5, 2.0)  # new status rows for the asset watchers
    db_error_seconds: float = 1.0  # how long an instance's statements fail after its lease renewal
    runner_stall_seconds: float = 12.0  # [smart_triggerer] runner_stall_seconds of the run (the wedge fault)
    # a two-team fleet ([core] multi_team): each team's instances beside the ``instances`` of no team, and
    # a share of the identities waited on by every team alike (the same kwargs), some also by no team
    teams: tuple[str, ...] = ("alpha", "beta")
    team_instances: int = 2  # per team: one may be struck while the other takes its shards
    team_share: float = 0.12
    consume_waits: int = 10  # consume-once waits whose messages each consume fault puts in the queue
    consume_poll: float = 1.0

    @classmethod
    def quick(cls, seed: int) -> Profile:
        """The short profile: about four minutes end to end, at least one fault of each kind."""
        return cls(seed=seed, minutes=2.25, waiters=300, assets=4, gap=(1.0, 2.5))

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    def bound(self, poll_interval: float) -> float:
        """The longest a wait may stall after its condition held (the issue's acceptance bound)."""
        return self.lease_seconds + poll_interval + 3.0

    @property
    def retake(self) -> float:
        """How long the next owner may take to run a wait whose holder was struck: a lease and a loop."""
        from smart_triggerer.config import Settings

        return self.lease_seconds + Settings.loop_seconds

    @property
    def margin(self) -> float:
        """Planned distance between a condition and a deadline, so the expected outcome is unambiguous."""
        return self.bound(max(*self.polls, self.push_poll)) + 3.0

    @property
    def slots(self) -> list[str]:
        """Every instance slot a fault may strike: those of no team (smart-N), then each team's."""
        return [f"smart-{n + 1}" for n in range(self.instances)] + [
            f"{team}-{n + 1}" for team in self.teams for n in range(self.team_instances)
        ]


@dataclass
class Identity:
    """One distinct wait; ``flip_at`` is its planned condition time (seconds into the chaos phase)."""

    kind: str
    name: str  # the table (primary), flag or HTTP key whose flip makes the condition hold
    tables: tuple[str, ...] = ()
    flip_at: float = 0.0
    earliest: float = 0.0  # constraints from members' deadlines (see _plan_timeouts)
    latest: float = float("inf")
    team: str | None = None  # trigger.team_name of its waiters (the team kind)

    @property
    def key(self) -> str:
        team = f"@{self.team}" if self.team else ""
        return f"{self.kind}:{'+'.join(self.tables) if self.tables else self.name}{team}"

    @property
    def message(self) -> str:
        """The consume kind's message, which its source hands out once."""
        return f"message for {self.name}"


@dataclass
class Waiter:
    """One seeded deferred task instance."""

    index: int
    identity: Identity
    wave: int
    poll_interval: float
    push: bool
    timeout_at: float | None = None  # seconds into the chaos phase
    ti_id: str = ""
    dag_id: str = ""
    map_index: int = -1

    def kwargs(self, http_url: str) -> dict[str, Any]:
        ident = self.identity
        if ident.kind in (POISON, TEAM):
            return {"url": http_url, "key": ident.name, "poll_interval": self.poll_interval}
        if ident.kind == CONSUME:
            return {"conn_id": "warehouse", "key": ident.name, "poll_interval": self.poll_interval}
        if ident.kind == TABLE:
            return {
                "conn_id": "warehouse",
                "required_tables": list(ident.tables),
                "status_table": STATUS_TABLE,
                "poll_interval": self.poll_interval,
                "notify_channel": LOAD_CHANNEL if self.push else None,
            }
        if ident.kind == FLAG:
            return {
                "conn_id": "warehouse",
                "sql": FLAG_SQL,
                "parameters": [ident.name],
                "poll_interval": self.poll_interval,
                "notify_channel": FLAG_CHANNEL if self.push else None,
            }
        return {"url": http_url, "key": ident.name, "poll_interval": self.poll_interval}


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    at: float
    hold: float  # how long the fault lasts before its recovery
    slot: str


@dataclass
class Plan:
    profile: Profile
    identities: list[Identity]
    waiters: list[Waiter]
    rows: list[tuple[float, str, str]]  # (at, table_name, status) for the asset watchers
    faults: list[FaultPlan]
    wave_at: float

    def describe(self) -> str:
        kinds = Counter(w.identity.kind for w in self.waiters)
        timeouts = sum(1 for w in self.waiters if w.timeout_at is not None)
        lines = [
            f"seed {self.profile.seed}: {len(self.waiters)} waiters on {len(self.identities)} "
            "identities "
            f"({dict(kinds)}), {timeouts} with a timeout, {len(self.rows)} status rows, "
            f"{len(self.faults)} faults, wave 2 at {self.wave_at:.0f}s",
            "fault schedule: "
            + ", ".join(f"{f.at:.0f}s {f.kind} {f.slot} ({f.hold:.1f}s)" for f in self.faults),
        ]
        return "\n".join(lines)


def make_plan(profile: Profile) -> Plan:
    rng = random.Random(profile.seed)
    total = profile.seconds
    unique = max(3, round(profile.waiters * (1 - profile.duplicates)))
    identities = _plan_identities(rng, unique, total)
    identities += _plan_team_twins(rng, profile, identities)
    waiters = _plan_waiters(rng, profile, identities)
    _plan_timeouts(rng, profile, waiters)
    for ident in identities:
        ident.flip_at = min(max(ident.flip_at, ident.earliest), ident.latest, total)
    faults = _plan_faults(rng, profile)
    # the poison group: first-wave waiters of one identity whose condition is the poison fault
    poison = Identity(POISON, "p_poison", flip_at=next((f.at for f in faults if f.kind == "poison"), total))
    identities.append(poison)
    waiters += [
        Waiter(len(waiters) + n, poison, 0, rng.choice(profile.polls), False) for n in range(POISON_MEMBERS)
    ]
    _plan_consumed(profile, faults, identities, waiters)
    return Plan(profile, identities, waiters, _plan_rows(rng, profile), faults, wave_at=0.3 * total)


def _plan_identities(rng: random.Random, unique: int, total: float) -> list[Identity]:
    kinds = (TABLE, FLAG, HTTP)
    identities = []
    for i in range(unique):
        kind = kinds[i % 3]
        name = {TABLE: f"load.t{i:05d}", FLAG: f"f{i:05d}", HTTP: f"h{i:05d}"}[kind]
        identities.append(Identity(kind, name, flip_at=rng.uniform(0.05, 0.9) * total))
    primaries = [ident.name for ident in identities if ident.kind == TABLE]
    for ident in identities:
        if ident.kind == TABLE:
            # a quarter wait for two tables: the condition is the later of two flips
            other = rng.choice(primaries) if rng.random() < 0.25 else ident.name
            ident.tables = tuple(sorted({ident.name, other}))
    return identities


def _plan_team_twins(rng: random.Random, profile: Profile, identities: list[Identity]) -> list[Identity]:
    """A share of the HTTP identities become the team kind, waited on by the first team; each gets a twin
    of the same key (the same kwargs) for every other team, and every other one one of no team too."""
    if not profile.teams:
        return []
    chosen = [i for i in identities if i.kind == HTTP]
    chosen = rng.sample(chosen, min(len(chosen), max(1, round(len(identities) * profile.team_share))))
    twins = []
    for number, ident in enumerate(chosen):
        ident.kind, ident.team = TEAM, profile.teams[0]
        teams: list[str | None] = list(profile.teams[1:]) + ([None] if number % 2 == 0 else [])
        twins += [Identity(TEAM, ident.name, flip_at=ident.flip_at, team=team) for team in teams]
    return twins


def _plan_consumed(
    profile: Profile, faults: list[FaultPlan], identities: list[Identity], waiters: list[Waiter]
) -> None:
    """The consume-once waits: ``consume_waits`` per consume fault (first wave, no deadline), each on a
    message of its own (a consumed event is never shared: its trigger is not deduplicable), which that
    fault puts in the queue."""
    for number, fault in enumerate(f for f in faults if f.kind == "consume"):
        for j in range(profile.consume_waits):
            ident = Identity(CONSUME, f"q{number:02d}_{j}", flip_at=fault.at)
            identities.append(ident)
            waiters.append(Waiter(len(waiters), ident, 0, profile.consume_poll, False))


def _plan_waiters(rng: random.Random, profile: Profile, identities: list[Identity]) -> list[Waiter]:
    hot = identities[: max(1, len(identities) // 10)]
    chosen = list(identities)  # every identity has at least one waiter
    while len(chosen) < profile.waiters:
        chosen.append(rng.choice(hot if rng.random() < 0.5 else identities))  # a few big groups
    rng.shuffle(chosen)
    waiters = []
    for index, ident in enumerate(chosen):
        push = ident.kind in (TABLE, FLAG) and rng.random() < 0.5
        poll = profile.push_poll if push else rng.choice(profile.polls)
        # a team's waits are seeded before the instances start: their team_name is set with the seeding
        wave = 1 if ident.kind != TEAM and rng.random() < profile.wave_share else 0
        waiters.append(Waiter(index, ident, wave, poll, push))
    return waiters


def _plan_timeouts(rng: random.Random, profile: Profile, waiters: list[Waiter]) -> None:
    """Some first-wave waiters get a deadline: most expire (their condition flips well after it), some
    beat it (their condition flips well before). Groups then mix members that time out and members that
    resume."""
    total, margin = profile.seconds, profile.margin
    wanted = round(len(waiters) * profile.timeout_share)
    # twins share their flip: a deadline constrains one identity's flip only
    candidates = [
        w for w in waiters if w.wave == 0 and len(w.identity.tables) <= 1 and w.identity.kind != TEAM
    ]
    for waiter in rng.sample(candidates, min(wanted, len(candidates))):
        ident = waiter.identity
        if rng.random() < 0.7:
            deadline = rng.uniform(0.1 * total, total - margin)
            earliest, latest = max(ident.earliest, deadline + margin), ident.latest
        else:
            deadline = rng.uniform(margin + 0.05 * total, 0.9 * total)
            earliest, latest = ident.earliest, min(ident.latest, deadline - margin)
        if earliest <= latest and latest > 0.03 * total:
            ident.earliest, ident.latest = earliest, latest
            waiter.timeout_at = deadline


def _plan_rows(rng: random.Random, profile: Profile) -> list[tuple[float, str, str]]:
    rows = []
    at = 1.0
    while at < profile.seconds - 3:
        status = rng.choices(("SUCCESS", "START", "FAILED"), weights=(65, 25, 10))[0]
        rows.append((at, f"asset.a{rng.randrange(profile.assets)}", status))
        at += rng.uniform(*profile.row_every)
    return rows


_HOLDS: dict[str, Callable[[random.Random, Profile], float]] = {
    "sigkill": lambda rng, p: rng.uniform(1.0, 5.0),  # down until restarted
    "sigstop": lambda rng, p: p.lease_seconds + rng.uniform(1.0, 4.0),  # frozen past its lease
    "sigterm": lambda rng, p: rng.uniform(0.5, 3.0),
    # the runner starved long enough to shed a step (its lag shows within a second or two)
    "lag": lambda rng, p: rng.uniform(8.0, 14.0),
    # the runner stopped alone (its loop wedged) past the stall threshold: the instance steps out
    "wedge": lambda rng, p: p.runner_stall_seconds + rng.uniform(3.0, 8.0),
    "pg_restart": lambda rng, p: rng.uniform(0.5, 3.0),  # PostgreSQL down
    "join": lambda rng, p: 0.0,
    "leave": lambda rng, p: 0.0,
    "freeze": lambda rng, p: p.lease_seconds + rng.uniform(1.0, 4.0),  # then SIGKILLed and replaced
    "partition": lambda rng, p: rng.uniform(0.5, 1.0) * p.lease_seconds + rng.uniform(0.0, 4.0),
    "db_error": lambda rng, p: 0.0,  # the window follows the renewal it waits for (db_error_seconds)
    # the size of the step, not a duration: the clock jumps at once
    "clock_step": lambda rng, p: rng.uniform(0.5, 2.0) * p.lease_seconds,
    "poison": lambda rng, p: 0.0,
    "nul_extra": lambda rng, p: 0.0,
    # the instance's remote log store answers nothing for a few leases: its leases must go on renewing
    "log_hang": lambda rng, p: p.lease_seconds * rng.uniform(1.5, 2.5),
    # messages queued, then SIGTERM of one instance as they are taken: its handover stores what it took;
    # down until restarted, then long enough for the next owners to take and store the rest
    "consume": lambda rng, p: p.consume_poll + rng.uniform(5.0, 7.0),
}
# Faults after which an instance whose shards moved may still run their coroutines for a while (stopped,
# cut off, its clock jumped, its runner wedged): a consume fault keeps this far from their end, so that
# no stale coroutine takes a message (what it took would die with its fenced-out event:
# docs/guides/deduplicable-triggers.md, on triggers whose source hands a message out once)
STALE_AFTER = ("sigkill", "sigstop", "freeze", "partition", "db_error", "clock_step", "wedge", "lag")
INSTANT = ("clock_step", "poison", "nul_extra")  # faults that take no time of the schedule's


def _plan_faults(rng: random.Random, profile: Profile) -> list[FaultPlan]:
    """Sequential fault episodes: first one of each kind (join before leave), then random ones."""
    first = rng.sample(
        [
            "sigkill",
            "sigstop",
            "sigterm",
            "pg_restart",
            "freeze",
            "partition",
            "db_error",
            "clock_step",
            "poison",
            "nul_extra",
            "lag",
            "wedge",
            "log_hang",
            "consume",
        ],
        14,
    )
    join_at = rng.randrange(len(first) + 1)
    first.insert(join_at, "join")
    first.insert(rng.randrange(join_at + 1, len(first) + 1), "leave")
    extra = f"smart-{profile.instances + 1}"
    faults: list[FaultPlan] = []
    at, joined, stale_until = 4.0, False, 0.0
    struck: dict[str, float] = {}  # slot -> when its last fault ended
    while True:
        kind = first[len(faults)] if len(faults) < len(first) else _random_kind(rng, joined)
        hold = _HOLDS[kind](rng, profile)
        if kind in ("consume", "log_hang"):  # away from the end of the last fault that leaves stale
            at = max(at, stale_until)  # coroutines (or lapses) behind
        takes = 0.0 if kind in INSTANT else hold
        if at + takes > profile.seconds - 8:
            break
        slot = {
            "join": extra,
            "leave": extra,
            "pg_restart": "postgres",
            "clock_step": "postgres",
            "poison": "source",
            "nul_extra": "source",
        }.get(kind) or rng.choice(_strikable(profile, kind, at, struck))
        faults.append(FaultPlan(kind, at, hold, slot))
        struck[slot] = at + takes
        if kind in STALE_AFTER:
            stale_until = max(stale_until, at + takes + profile.retake + 2.0)
        joined = {"join": True, "leave": False}.get(kind, joined)
        at += takes + rng.uniform(*profile.gap)
    return faults


# a team instance struck this long after its team's other one was: that one is back (restarted, woken,
# reconnected) and holds its shards again, so that the team always has an instance to take over
TEAM_RECOVERY_SECONDS = 20.0


def _strikable(profile: Profile, kind: str, at: float, struck: dict[str, float]) -> list[str]:
    """The slots a fault of ``kind`` may strike at ``at``: those of no team for the consume fault (its waits
    are of no team) and the log_hang fault (they end most triggers, so uploads happen); a team's slot only
    when the team's other instances have recovered from their last fault."""
    teamless = profile.slots[: profile.instances]
    if kind in ("consume", "log_hang"):
        return teamless
    ready = [
        slot
        for slot in profile.slots[profile.instances :]
        if all(
            at - struck.get(other, -1e9) >= TEAM_RECOVERY_SECONDS
            for other in profile.slots[profile.instances :]
            if other != slot and team_of(other) == team_of(slot)
        )
    ]
    return teamless + ready


def _random_kind(rng: random.Random, joined: bool) -> str:
    kinds = [
        "sigkill",
        "sigstop",
        "sigterm",
        "pg_restart",
        "leave" if joined else "join",
        "freeze",
        "partition",
        "db_error",
        "clock_step",
        "lag",
        "wedge",
        "log_hang",
        "consume",
    ]
    return rng.choices(kinds, weights=(3, 2, 2, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1))[0]
