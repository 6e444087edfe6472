"""The triggerer's own state in PostgreSQL: migrations, membership, shard leases, trigger identities.

All SQL lives in ``sql/queries.sql`` (one named query each) and ``sql/NNNN_*.sql`` migrations; this module
has one method per query and runs them on the session it is given (Airflow's own SQLAlchemy session, so
our writes can share a transaction with Airflow's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from smart_triggerer.config import ConfigError
from smart_triggerer.db import migrations as migration_files
from smart_triggerer.db.migrations import Migration
from smart_triggerer.db.notices import CHANNEL, notice_payload
from smart_triggerer.errors import ExitCode, UserError
from smart_triggerer.placement.shards import Candidate

SCHEMA = "smart_triggerer"

# the placement this release computes (instance.placement, 0012_placement.sql): 1 rendezvous by capacity,
# 2 filters and bounded loads (placement.py)
PLACEMENT = 2


# a migration file with this line cannot be run on by instances that do not know it: when it is applied,
# older instances stop (one line, exit code 8) instead of working on a schema they would misread
BREAKS_OLDER = "-- breaks-older-instances"


class SchemaTooNew(UserError, RuntimeError):
    """A newer release applied a migration that instances of this release cannot run on."""

    exit_code = ExitCode.SCHEMA_TOO_NEW

    def __init__(self, needed: int, known: int) -> None:
        super().__init__(
            f"the smart_triggerer schema needs instances that know its version {needed} (a newer release "
            f"changed it incompatibly); this release knows up to version {known}: run the newer release "
            "here too, or see docs/operations/upgrade.md to go back"
        )


class ShardCountMismatch(UserError, RuntimeError):
    """The configured number of shards differs from the one this deployment was created with."""

    exit_code = ExitCode.SHARD_COUNT


@cache
def queries() -> dict[str, str]:
    """``sql/queries.sql``: each query follows a ``-- name: NAME`` line."""
    return migration_files.named_queries("smart_triggerer.db")


@cache
def migrations() -> tuple[Migration, ...]:
    """(version, name, sql) of every migration shipped, in order (read once: a running instance compares
    the schema with them every few seconds)."""
    return migration_files.shipped("smart_triggerer.db")


# the change feed's triggers (queries.sql, install_*): created, deleted trigger rows; new asset watchers
FEED_TRIGGERS = ("install_feed_created", "install_feed_deleted", "install_feed_watched")

# what a group merges: kwarg -> [rule, value] (see triggers.identity.MERGE_RULES)
Execution = dict[str, list[Any]]


@dataclass(frozen=True, slots=True)
class WaitingTrigger:
    trigger_id: int
    identity_hash: int
    shard: int
    dedupable: bool
    has_task: bool
    execution: Execution
    hold_left: float = 0.0  # seconds until an event may resume it (see resume_hold_seconds)
    error: str | None = None  # its kwargs could not be read: its tasks fail with this cause
    timeout_in: float | None = None  # seconds until its deferred task's trigger_timeout
    held_event: str | None = None  # an event stored for it while held (0013_held_events.sql)
    held_in: float = 0.0  # seconds until that event may resume it


@dataclass(frozen=True, slots=True)
class FeedPosition:
    """Where a read of the change feed got to (a snapshot xmin) and how many new rows have no identity."""

    xmin: str
    unhashed: int


@dataclass(frozen=True, slots=True)
class LiveMember:
    candidate: Candidate
    placement: int  # the placement this member computes (PLACEMENT)
    lapses_in: float  # seconds until its membership lapses unless renewed


@dataclass(frozen=True, slots=True)
class ShardLoad:
    shard: int
    owner: int | None  # by the database clock
    groups: int | None  # as its owner last published (None: no owner has loaded it yet)


@dataclass(frozen=True)
class NewIdentity:
    trigger_id: int
    identity_hash: int
    shard: int
    dedupable: bool
    execution: Execution
    error: str | None = None
    description: str | None = None


# page_groups lists a group's members from trigger_identity_hash_member in order and pulls them only as far
# as needed; estimating a group small, the planner would rather read it whole (bitmap scan) and sort it, and
# with statistics of other groups (a big group's, stale) scan the whole table once per group
PAGE_GROUPS_PLANNER = "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off"
# a sweep reads rows without an identity in id order from where its last batch ended, and stops at the
# batch's limit; estimating the anti-join to leave a row or two (no statistics yet after a burst), the
# planner would rather scan every trigger row, probe each one's identity and sort what is left, once per
# batch of a start (measured: docs/design.md). For the batch's transaction: its insert of the identities
# (from unnest, no index to choose) plans the same either way
SWEEP_PLANNER = "SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off"


class Store:
    """One method per query; the caller owns the session and its transaction."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def _run(self, query: str, /, **params: Any) -> Any:
        return self.session.execute(text(queries()[query]), params)

    # --- schema ---

    def migrate(self, shards: int) -> list[int]:
        """Apply pending migrations and pin the shard count, safely when instances start at once."""
        self._run("startup_lock_timeout")
        self._run("lock_schema")
        done = []
        for version, _name, sql in migration_files.apply(self.session, SCHEMA, migrations()):
            if BREAKS_OLDER in sql.splitlines():
                self._run("raise_setting", key="oldest_reader", value=str(version))
            done.append(version)
        self.refuse_newer_schema()
        self._pin_shards(shards)
        self.ensure_feed()
        return done

    def _pin_shards(self, shards: int) -> None:
        self._run("put_setting", key="shards", value=str(shards))
        self.check_shards(shards)
        self._run("create_shards", shards=shards, queues="")

    def refuse_newer_schema(self) -> None:
        """Newer releases' migrations this one does not know are fine unless one of them breaks older
        instances (``BREAKS_OLDER``): then this instance must not run on the schema."""
        needed = self.oldest_reader()
        known = max((version for version, _name, _sql in migrations()), default=0)
        if needed > known:
            raise SchemaTooNew(needed, known)

    def oldest_reader(self) -> int:
        """The lowest schema version an instance must know to run here (0: any)."""
        stored = self._run("get_setting", key="oldest_reader").scalar()
        return int(stored) if stored is not None else 0

    def schema_version(self) -> int:
        return max((row[0] for row in self._run("applied_migrations")), default=0)

    def pinned_shards(self) -> int | None:
        """The deployment's shard count, as its first instance pinned it."""
        stored = self._run("get_setting", key="shards").scalar()
        return int(stored) if stored is not None else None

    def check_shards(self, shards: int) -> None:
        """Refuse a shard count other than the one this deployment was created with (if it exists)."""
        if not self.schema_exists():
            return
        stored = self.pinned_shards()
        if stored is not None and stored != shards:
            raise ShardCountMismatch(
                f"[smart_triggerer] shards is {shards}, but this deployment was created with {stored}: "
                f"set AIRFLOW__SMART_TRIGGERER__SHARDS={stored} (the shard count is fixed per deployment, "
                "so that identical waits always hash to one shard)"
            )

    def schema_exists(self) -> bool:
        """False until the first instance has migrated this database."""
        return self.session.execute(text(f"SELECT to_regclass('{SCHEMA}.instance')")).scalar() is not None

    # --- membership and leases ---

    def register(
        self,
        job_id: int,
        hostname: str,
        capacity: int,
        queues: str | None,
        *,
        health_url: str | None,
        shards: int,
        lease_seconds: float | None = None,
    ) -> None:
        self._run("create_shards", shards=shards, queues=queues or "")
        self._run(
            "register_instance",
            job_id=job_id,
            hostname=hostname,
            capacity=capacity,
            queues=queues,
            health_url=health_url,
            placement=PLACEMENT,
            lease_seconds=lease_seconds,
        )

    def refuse_other_leases(self, job_id: int, lease_seconds: float) -> None:
        """A fleet must agree on ``lease_seconds``: peers judge each other's membership by their own, so a
        crashed instance of a longer lease is taken over only after it, and one of a shorter lease loses
        its shards to peers that think it alive."""
        others = self._run("other_leases", job_id=job_id, lease_seconds=lease_seconds).all()
        if others:
            theirs = ", ".join(sorted({f"{float(r.lease_seconds):g}" for r in others}))
            who = ", ".join(f"{r.hostname} job {r.job_id}" for r in others)
            raise ConfigError(
                f"[smart_triggerer] lease_seconds is {lease_seconds:g} here but {theirs} on the live "
                f"instances ({who}): a fleet must agree; set the same value, or change it on every instance "
                "in one restart"
            )

    def live_queue_sets(self, lease_seconds: float) -> list[str]:
        """The ``--queues`` sets of live instances ('' for none)."""
        rows = self._run("live_queue_sets", lease_seconds=lease_seconds)
        return [r[0] for r in rows]

    def heartbeat(
        self, job_id: int, lease_seconds: float, *, feed_xmin: str | None = None, **counters: Any
    ) -> tuple[bool, float]:
        """Renew membership; ``feed_xmin``: how far this instance has read the change feed. Returns whether
        the membership was still live (by the database clock) before this renewal (False too when the row
        is gone) and the database clock (epoch seconds)."""
        row = self._run(
            "heartbeat_instance", job_id=job_id, lease_seconds=lease_seconds, feed_xmin=feed_xmin, **counters
        ).one_or_none()
        if row is None:
            return False, float(self._run("db_clock").scalar_one())
        return bool(row.was_live), float(row.db_now)

    def live_candidates(self, lease_seconds: float, queues: str | None) -> list[LiveMember]:
        """Live members as the placement sees them (placement.py), with the placement each computes."""
        rows = self._run("live_instances", lease_seconds=lease_seconds, queues=queues)
        return [
            LiveMember(
                Candidate(r.job_id, r.capacity, accepting=r.accepting, limit=r.limit_groups),
                r.placement,
                float(r.lapses_in),
            )
            for r in rows
        ]

    def shard_loads(self, queues: str | None) -> list[ShardLoad]:
        """Each shard's live owner (None: none) and the groups its owner last published."""
        return [
            ShardLoad(r.shard, r.owner_job_id, r.groups)
            for r in self._run("shard_loads", queues=queues or "")
        ]

    def claim_shards(
        self,
        job_id: int,
        shards: Iterable[int],
        lease_seconds: float,
        queues: str | None,
        loads: Mapping[int, int] | None = None,
    ) -> set[int]:
        """Renew and take leases; ``loads``: groups this instance holds per shard it has loaded, published
        with the renewal."""
        published = sorted((loads or {}).items())
        rows = self._run(
            "claim_shards",
            job_id=job_id,
            shards=sorted(shards),
            lease_seconds=lease_seconds,
            queues=queues or "",
            load_shards=[s for s, _ in published],
            load_groups=[g for _, g in published],
        )
        return {r.shard for r in rows}

    def held_shards(self, job_id: int, shards: Iterable[int], queues: str | None) -> set[int]:
        """Shards among these this instance holds by the database clock (no lock taken)."""
        rows = self._run("held_shards", job_id=job_id, shards=sorted(shards), queues=queues or "")
        return {r.shard for r in rows}

    def fence(self, job_id: int, shards: Iterable[int], queues: str | None) -> set[int]:
        """Shards whose lease this instance still holds, share-locked until the transaction ends."""
        rows = self._run("fence_shards", job_id=job_id, shards=sorted(shards), queues=queues or "")
        return {r.shard for r in rows}

    def release_shards(self, job_id: int, shards: Iterable[int], queues: str | None) -> None:
        self._run("release_shards", job_id=job_id, shards=sorted(shards), queues=queues or "")

    def stop_instance(self, job_id: int) -> None:
        """Leave the membership and release every lease."""
        self._run("stop_instance", job_id=job_id)

    def notify_membership(self, job_id: int, queues: str | None) -> None:
        """Listening peers of this queue set renew their leases once this transaction commits
        (notices.py)."""
        self._run("notify_membership", channel=CHANNEL, payload=notice_payload(job_id, queues))

    def remove_feed_if_last(self, job_id: int, lease_seconds: float) -> bool:
        """The last live instance reading the change feed removes its triggers from Airflow's tables
        (True then). Under the schema lock, so that an instance starting at the same time either sees this
        one live or installs them again; bounded waits (a lock it cannot get within a second is left)."""
        self._run("short_lock_timeout")
        self._run("lock_schema")
        if self._run("live_feed_readers", job_id=job_id, lease_seconds=lease_seconds).scalar_one():
            return False
        self._run("remove_feed")
        return True

    def feed_present(self) -> bool:
        return bool(self._run("feed_triggers_present").scalar_one() == len(FEED_TRIGGERS))

    def delete_unused_triggers(self, trigger_ids: Iterable[int]) -> set[int]:
        """Delete those of these trigger rows nothing refers to any more; the ids deleted."""
        ids = sorted(set(trigger_ids))
        if not ids:
            return set()
        return {int(r[0]) for r in self._run("delete_unused_triggers", trigger_ids=ids)}

    def release_left_waits(self) -> list[int]:
        """Clear the trigger of task rows that are no longer deferred; the triggers they named."""
        return [int(r[0]) for r in self._run("release_left_waits")]

    def left_index_state(self) -> str:
        """``valid``, ``building``, ``invalid`` (a failed build) or ``missing``."""
        row = self._run("left_index_state").first()
        if row is None:
            return "missing"
        valid, building = row
        return "valid" if valid else "building" if building else "invalid"

    def not_waited_on(self, shards: Iterable[int]) -> set[int]:
        """Triggers of these shards whose row exists although nothing waits on it."""
        if not shards:
            return set()
        return {r[0] for r in self._run("not_waited_on", shards=sorted(shards))}

    def ensure_feed_locked(self) -> bool:
        """``ensure_feed`` under the schema lock (see ``stop_instance``)."""
        self._run("lock_schema")
        return self.ensure_feed()

    def instances(self, lease_seconds: float, keep_stopped_seconds: float = 1e9) -> list[dict[str, Any]]:
        """Live instances and those stopped within ``keep_stopped_seconds``."""
        return [
            dict(r._mapping)
            for r in self._run(
                "instances", lease_seconds=lease_seconds, keep_stopped_seconds=keep_stopped_seconds
            )
        ]

    def page_group_order(self, dag_ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """Every group of deferred tasks in these DAGs, biggest first: (identity_hash, alone, queue,
        members, dags, waiting_since)."""
        return [tuple(r) for r in self._run("page_group_order", dag_ids=list(dag_ids))]

    def page_groups(
        self,
        groups: Sequence[tuple[int, int | None, str]],
        dag_ids: Sequence[str],
        members: int,
        scanned: int,
    ) -> list[dict[str, Any]]:
        """Details of these groups ((identity_hash, alone, queue), in page order), with their first
        ``members`` deferred tasks in ``dag_ids`` among their first ``scanned`` members."""
        self.session.execute(text(PAGE_GROUPS_PLANNER))
        rows = self._run(
            "page_groups",
            hashes=[g[0] for g in groups],
            alone=[g[1] for g in groups],
            queues=[g[2] for g in groups],
            dag_ids=list(dag_ids),
            members=members,
            scanned=scanned,
            multi_team=multi_team_enabled(),
        )
        return [dict(r._mapping) for r in rows]

    def page_chart(self) -> list[dict[str, Any]]:
        return [dict(r._mapping) for r in self._run("page_chart")]

    # --- identities ---

    def unhashed_triggers(
        self,
        queues: RowScope | Sequence[str] | None,
        limit: int,
        after_xid: str | None = None,
        after_id: int = 0,
    ) -> list[tuple[int, str, str, str | None]]:
        """Trigger rows without an identity, in id order after ``after_id``: all of them (a sweep), or
        (``after_xid``) those new since."""
        if after_xid is None:
            self.session.execute(text(SWEEP_PLANNER))
        rows = self._run(
            "unhashed_triggers", **scope_params(queues), limit=limit, after_xid=after_xid, after_id=after_id
        )
        return [(r.id, r.classpath, r.kwargs, r.team_name) for r in rows]

    def insert_identities(self, identities: Sequence[NewIdentity]) -> None:
        if not identities:
            return
        self._run(
            "insert_identities",
            trigger_ids=[i.trigger_id for i in identities],
            hashes=[i.identity_hash for i in identities],
            shards=[i.shard for i in identities],
            dedupable=[i.dedupable for i in identities],
            executions=[json.dumps(i.execution) for i in identities],
            errors=[i.error for i in identities],
            descriptions=[i.description for i in identities],
        )

    def record_sample(
        self, job_id: int, waiters: int, groups: int, polls_saved: float, *, prune: bool
    ) -> None:
        self._run(
            "record_sample",
            job_id=job_id,
            waiters=waiters,
            groups=groups,
            polls_saved=polls_saved,
            prune=prune,
        )

    def hold_events(self, held: Sequence[tuple[int, str, float]]) -> dict[int, float]:
        """Store events held for members: (trigger id, event text, hold seconds) each; returns each stored
        member's seconds until release (a member whose trigger row is gone is left out)."""
        if not held:
            return {}
        ids, events, holds = zip(*held, strict=True)
        rows = self._run("hold_events", trigger_ids=list(ids), events=list(events), holds=list(holds))
        return {int(r[0]): float(r[1]) for r in rows}

    def release_held_events(self, trigger_ids: Iterable[int]) -> None:
        ids = sorted(trigger_ids)
        if ids:
            self._run("release_held_events", trigger_ids=ids)

    def dead_event(self, trigger_id: int, payload: str, attempts: int, cause: str) -> None:
        self._run("dead_event", trigger_id=trigger_id, payload=payload, attempts=attempts, cause=cause)

    def ping(self) -> None:
        self._run("ping")

    def snapshot_xmin(self) -> str:
        """Where the next incremental read of waiters starts (a transaction id, as text)."""
        xmin: str = self._run("snapshot_xmin").scalar_one()
        return xmin

    def waiting_triggers(
        self,
        shards: Iterable[int],
        queues: RowScope | Sequence[str] | None,
        *,
        after_xid: str | None = None,
        hold_seconds: float = 0.0,
    ) -> list[WaitingTrigger]:
        """Every waiter of these shards, or (``after_xid``) those that arrived or were watched anew since."""
        if not shards:
            return []
        rows = self._run(
            "waiting_triggers",
            shards=sorted(shards),
            **scope_params(queues),
            after_xid=after_xid,
            hold_seconds=hold_seconds,
        )
        return [_waiting(r) for r in rows]

    def deleted_triggers(self, after_xid: str) -> set[int]:
        """Trigger rows deleted since ``after_xid`` (nothing waits on them any more)."""
        return {r[0] for r in self._run("deleted_triggers", after_xid=after_xid)}

    def feed_probe(self, load_after: str, hash_after: str) -> tuple[str, bool]:
        """A snapshot xmin, and whether anything changed since the two read positions (one statement)."""
        row = self._run("feed_probe", load_after=load_after, hash_after=hash_after).one()
        return row.xmin, bool(row.changed)

    def feed_position(self, after_xid: str, queues: RowScope | Sequence[str] | None) -> FeedPosition:
        row = self._run("feed_position", after_xid=after_xid, **scope_params(queues)).one()
        return FeedPosition(row.xmin, int(row.unhashed))

    def sweep_position(self, queues: RowScope | Sequence[str] | None) -> FeedPosition:
        row = self._run("sweep_position", **scope_params(queues)).one()
        return FeedPosition(row.xmin, int(row.unhashed))

    def prune_feed(self, lease_seconds: float) -> int:
        """Drop change-feed rows every live instance has read; returns how many."""
        return int(self._run("prune_feed", lease_seconds=lease_seconds).rowcount)

    def ensure_feed(self) -> bool:
        """Install the change feed's triggers on Airflow's tables if any is missing; True if it was."""
        if self.feed_present():
            return False
        self._run("short_lock_timeout")
        for name in FEED_TRIGGERS:
            self._run(name)
        return True

    def claim_triggers(self, job_id: int, ids: Iterable[int]) -> None:
        self._run("claim_triggers", job_id=job_id, ids=sorted(ids))


def multi_team_enabled() -> bool:
    from airflow.configuration import conf

    return conf.getboolean("core", "multi_team", fallback=False)


def space_key(queues: Iterable[str] | None, team: str | None) -> str | None:
    """A shard space's key (``shard_lease.queues``, ``instance.queues``): the sorted queue set, then
    ``@team`` for a team's instances. Rows of the spaces before teams keep their keys."""
    key = ",".join(sorted(queues)) if queues else None
    return key if team is None else f"{key or ''}@{team}"


def split_space(key: str) -> tuple[set[str], str | None]:
    """(queue set, team) of a space key."""
    queues, _, team = key.partition("@")
    return {q for q in queues.split(",") if q}, team or None


@dataclass(frozen=True)
class RowScope:
    """Which trigger rows an instance may run: its ``--queues`` (None: rows without a queue) and, with
    ``[core] multi_team``, its ``--team-name`` (None: rows of no team), as Airflow's triggerer filters."""

    queues: tuple[str, ...] | None = None
    team: str | None = None
    multi_team: bool = False


def scope_params(scope: RowScope | Sequence[str] | None) -> dict[str, Any]:
    """The row filter's parameters (a bare queue list: no team filter)."""
    if not isinstance(scope, RowScope):
        scope = RowScope(tuple(scope) if scope else None)
    return {
        "queues": list(scope.queues) if scope.queues else None,
        "team": scope.team,
        "multi_team": scope.multi_team,
    }


def _waiting(r: Any) -> WaitingTrigger:
    (
        trigger_id,
        identity_hash,
        shard,
        dedupable,
        execution,
        error,
        hold_left,
        has_task,
        timeout_in,
        held_event,
        held_in,
    ) = r
    return WaitingTrigger(
        trigger_id,
        identity_hash,
        shard,
        dedupable,
        has_task,
        _execution(execution),
        float(hold_left),
        error,
        None if timeout_in is None else float(timeout_in),
        held_event,
        float(held_in or 0.0),
    )


def _execution(stored: str | None) -> dict[str, Any]:
    """A member's execution kwargs from their stored text (a copy: the caller may keep it)."""
    return dict(_parsed_execution(stored) or {}) if stored else {}


@lru_cache(maxsize=4096)
def _parsed_execution(stored: str) -> Mapping[str, Any]:
    # Parsed once per distinct text: a takeover reads tens of thousands of rows that carry a few settings
    # (a poll interval), and psycopg2 decoding each row's JSON took the supervisor's CPU at a takeover
    # (measured: docs/design.md).
    # Nothing changes a member's settings in place (groups merge them into new values).
    parsed: dict[str, Any] = json.loads(stored)
    return parsed
