"""A Jepsen-style chaos run of the smart triggerer: workload, faults and checker in one place.

``bench/chaos.py`` (20 minutes, thousands of waiters) and ``tests/e2e/test_chaos.py`` (a short seeded run)
share this module, so the suite exercises the very checker the long run relies on.

What runs: a private PostgreSQL whose clock can be stepped (libfaketime; it must also be restarted, so never
the one ``SMART_TRIGGERER_DSN`` names), an Airflow metadata database with an audit trigger of ours on
``task_instance`` and ``asset_event``, a "warehouse" database (an ETL status table, a flags table), an HTTP
condition source, N ``smart-triggerer run`` instances, each reaching the metadata database through a TCP
proxy of its own (``tcp_proxy.py``) and naming its sessions (``PGAPPNAME`` = the instance's name), and the
dataset bridge's outbox (the instances' asset manager) with a relay to an inbox stub. Seeded deferred waiters
(``TableLoadTrigger`` push and pull, ``SqlConditionTrigger``, ``PollTrigger``; 40% duplicates; some with a
``trigger_timeout`` due during the run) and status-table asset watchers wait while conditions flip, new
status rows arrive and a seeded schedule of faults runs:

- ``sigkill``, ``sigstop`` (past the lease, then SIGCONT), ``sigterm`` (and a restart), ``join`` and
  ``leave`` (a fourth instance), ``pg_restart`` (PostgreSQL down for a while);
- ``freeze``: an instance SIGSTOPped while one of its sessions is inside a transaction (seen in
  pg_stat_activity, confirmed 'idle in transaction' after the stop) and never woken: SIGKILLed after the
  hold and replaced, as an orchestrator would;
- ``partition``: the instance's proxy stops forwarding both ways for the hold, then heals;
- ``db_error``: right after the instance renewed its leases (its lease rows' expiry moved), its sessions
  are terminated again and again for about a second, until its log says "database unavailable";
- ``clock_step``: the database's clock jumps forward (forward only; see ``fake_clock.py``);
- ``poison``: the source hands one group of waiters an event with a ``\u0000`` (jsonb refuses it): their
  tasks must fail with the cause ("could not be stored"), exactly once;
- ``nul_extra``: an asset watcher's event whose extra holds a ``\u0000``: one asset event in Airflow, no
  outbox row in the producer's transaction, dead-lettered alone by the relay's sweep, all other events
  delivered.

What is checked, from the databases alone: every waiter left DEFERRED exactly once (the audit trigger logs
every transition with ``clock_timestamp()``), with its own event, or timed out no earlier than due, or (the
poison group) failed with the cause; nothing else failed; every SUCCESS status row made exactly one asset
event, delivered by the relay; and no wait stalled longer than ``lease + poll interval + 3 s`` after its
condition held (condition times are written by the same PostgreSQL server, so one clock measures both ends;
the clock's steps are taken out of every duration, ``fake_clock.continuous``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg2
from aiohttp import web

from devkit.devstack import AirflowConfig, AirflowStack, Component, migrate
from devkit.pgserver import EmbeddedPostgres, create_database, sqlalchemy_url
from tests.helpers.fake_clock import ClockStep, FakeClockPostgres, continuous, ensure_libfaketime
from tests.helpers.tcp_proxy import Proxies

ROOT = Path(__file__).resolve().parents[2]
TABLE, FLAG, HTTP, POISON = "table", "flag", "http", "poison"
CLASSPATHS = {
    TABLE: "triggers.table_load.TableLoadTrigger",
    FLAG: "triggers.sql_condition.SqlConditionTrigger",
    HTTP: "bench.triggers.PollTrigger",
    POISON: "tests.helpers.chaos_triggers.SourcePollTrigger",
}
STATUS_TABLE = "meta.detail_process_table_status"
LOAD_CHANNEL, FLAG_CHANNEL, ASSET_CHANNEL = "table_loads", "flags", "status_rows"
FLAG_SQL = "SELECT value FROM chaos.flags WHERE name = $1"
FAULT_KINDS = ("sigkill", "sigstop", "sigterm", "join", "leave", "pg_restart", "freeze", "partition",
               "db_error", "clock_step", "poison", "nul_extra")
ONCE = ("poison", "nul_extra")  # faults of the workload: once per run
POISON_MEMBERS = 2  # tasks that share the poison event (one group)
NUL_KEY, NUL_ASSET = "nul-extra", "chaos://extra/nul"
# what jsonb refuses: the poison event's payload and the watcher event's extra carry it
NUL_NOTE = "a NUL \x00 byte"
REJECTED_MARK = "could not be stored"  # the cause the supervisor fails a poison event's tasks with
SINK, SINK_SECRET_ENV, BRIDGE_SOURCE = "sink", "CHAOS_SINK_SECRET", "chaos"
ASSET_DAG = "chaos_assets"
STARTED_MARK = "smart triggerer started"
Log = Callable[[str], None]


# --------------------------------------------------------------------------------------------------
# Profile and plan: everything random is drawn here, from random.Random(seed), before anything runs.
# --------------------------------------------------------------------------------------------------


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

    @classmethod
    def quick(cls, seed: int) -> Profile:
        """The short profile: about three minutes end to end, at least one fault of each kind."""
        return cls(seed=seed, minutes=1.5, waiters=300, assets=4, gap=(1.0, 2.5))

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    def bound(self, poll_interval: float) -> float:
        """The longest a wait may stall after its condition held (the issue's acceptance bound)."""
        return self.lease_seconds + poll_interval + 3.0

    @property
    def retake(self) -> float:
        """How long the next owner may take to run a wait whose holder was struck: a lease and a loop."""
        from triggerer.config import Settings

        return self.lease_seconds + Settings.loop_seconds

    @property
    def margin(self) -> float:
        """Planned distance between a condition and a deadline, so the expected outcome is unambiguous."""
        return self.bound(max(*self.polls, self.push_poll)) + 3.0


@dataclass
class Identity:
    """One distinct wait; ``flip_at`` is its planned condition time (seconds into the chaos phase)."""

    kind: str
    name: str  # the table (primary), flag or HTTP key whose flip makes the condition hold
    tables: tuple[str, ...] = ()
    flip_at: float = 0.0
    earliest: float = 0.0  # constraints from members' deadlines (see _plan_timeouts)
    latest: float = float("inf")

    @property
    def key(self) -> str:
        return f"{self.kind}:{'+'.join(self.tables) if self.tables else self.name}"


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
        if ident.kind == POISON:
            return {"url": http_url, "key": ident.name, "poll_interval": self.poll_interval}
        if ident.kind == TABLE:
            return {"conn_id": "warehouse", "required_tables": list(ident.tables),
                    "status_table": STATUS_TABLE, "poll_interval": self.poll_interval,
                    "notify_channel": LOAD_CHANNEL if self.push else None}
        if ident.kind == FLAG:
            return {"conn_id": "warehouse", "sql": FLAG_SQL, "parameters": [ident.name],
                    "poll_interval": self.poll_interval,
                    "notify_channel": FLAG_CHANNEL if self.push else None}
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
        lines = [f"seed {self.profile.seed}: {len(self.waiters)} waiters on {len(self.identities)} "
                 "identities "
                 f"({dict(kinds)}), {timeouts} with a timeout, {len(self.rows)} status rows, "
                 f"{len(self.faults)} faults, wave 2 at {self.wave_at:.0f}s",
                 "fault schedule: " + ", ".join(f"{f.at:.0f}s {f.kind} {f.slot} ({f.hold:.1f}s)"
                                                for f in self.faults)]
        return "\n".join(lines)


def make_plan(profile: Profile) -> Plan:
    rng = random.Random(profile.seed)
    total = profile.seconds
    unique = max(3, round(profile.waiters * (1 - profile.duplicates)))
    identities = _plan_identities(rng, unique, total)
    waiters = _plan_waiters(rng, profile, identities)
    _plan_timeouts(rng, profile, waiters)
    for ident in identities:
        ident.flip_at = min(max(ident.flip_at, ident.earliest), ident.latest, total)
    faults = _plan_faults(rng, profile)
    # the poison group: first-wave waiters of one identity whose condition is the poison fault
    poison = Identity(POISON, "p_poison", flip_at=next((f.at for f in faults if f.kind == "poison"), total))
    identities.append(poison)
    waiters += [Waiter(len(waiters) + n, poison, 0, rng.choice(profile.polls), False)
                for n in range(POISON_MEMBERS)]
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


def _plan_waiters(rng: random.Random, profile: Profile, identities: list[Identity]) -> list[Waiter]:
    hot = identities[: max(1, len(identities) // 10)]
    chosen = list(identities)  # every identity has at least one waiter
    while len(chosen) < profile.waiters:
        chosen.append(rng.choice(hot if rng.random() < 0.5 else identities))  # a few big groups
    rng.shuffle(chosen)
    waiters = []
    for index, ident in enumerate(chosen):
        push = ident.kind != HTTP and rng.random() < 0.5
        poll = profile.push_poll if push else rng.choice(profile.polls)
        wave = 1 if rng.random() < profile.wave_share else 0
        waiters.append(Waiter(index, ident, wave, poll, push))
    return waiters


def _plan_timeouts(rng: random.Random, profile: Profile, waiters: list[Waiter]) -> None:
    """Some first-wave waiters get a deadline: most expire (their condition flips well after it), some
    beat it (their condition flips well before). Groups then mix members that time out and members that
    resume."""
    total, margin = profile.seconds, profile.margin
    wanted = round(len(waiters) * profile.timeout_share)
    candidates = [w for w in waiters if w.wave == 0 and len(w.identity.tables) <= 1]
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
}
INSTANT = ("clock_step", "poison", "nul_extra")  # faults that take no time of the schedule's


def _plan_faults(rng: random.Random, profile: Profile) -> list[FaultPlan]:
    """Sequential fault episodes: first one of each kind (join before leave), then random ones."""
    first = rng.sample(["sigkill", "sigstop", "sigterm", "pg_restart", "freeze", "partition", "db_error",
                        "clock_step", "poison", "nul_extra"], 10)
    join_at = rng.randrange(len(first) + 1)
    first.insert(join_at, "join")
    first.insert(rng.randrange(join_at + 1, len(first) + 1), "leave")
    slots = [f"smart-{n + 1}" for n in range(profile.instances)]
    extra = f"smart-{profile.instances + 1}"
    faults: list[FaultPlan] = []
    at, joined = 4.0, False
    while True:
        kind = first[len(faults)] if len(faults) < len(first) else _random_kind(rng, joined)
        hold = _HOLDS[kind](rng, profile)
        takes = 0.0 if kind in INSTANT else hold
        if at + takes > profile.seconds - 8:
            break
        slot = ({"join": extra, "leave": extra, "pg_restart": "postgres", "clock_step": "postgres",
                 "poison": "source", "nul_extra": "source"}.get(kind) or rng.choice(slots))
        faults.append(FaultPlan(kind, at, hold, slot))
        joined = {"join": True, "leave": False}.get(kind, joined)
        at += takes + rng.uniform(*profile.gap)
    return faults


def _random_kind(rng: random.Random, joined: bool) -> str:
    kinds = ["sigkill", "sigstop", "sigterm", "pg_restart", "leave" if joined else "join", "freeze",
             "partition", "db_error", "clock_step"]
    return rng.choices(kinds, weights=(3, 2, 2, 1, 1, 2, 2, 2, 1))[0]


# --------------------------------------------------------------------------------------------------
# Databases: the warehouse the triggers watch, and our audit in the metadata database.
# --------------------------------------------------------------------------------------------------

WAREHOUSE_DDL = f"""
CREATE SCHEMA meta;
CREATE TABLE {STATUS_TABLE} (
    id bigserial PRIMARY KEY, table_name text, status text,
    created_dttm timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE SCHEMA chaos;
CREATE TABLE chaos.flags (
    name text PRIMARY KEY, value boolean NOT NULL DEFAULT false, flipped_at timestamptz
);
CREATE TABLE chaos.http_flip (key text PRIMARY KEY, at timestamptz NOT NULL);
"""

# Every transition of a task instance into or out of DEFERRED, every rewrite of a resolved one's
# next_method/next_kwargs and every deletion, with the database clock and the writing transaction.
AUDIT_DDL = """
CREATE SCHEMA chaos;
CREATE TABLE chaos.ti_audit (
    seq bigserial PRIMARY KEY,
    ti_id uuid NOT NULL,
    at timestamptz NOT NULL,
    op text NOT NULL,
    old_state text, new_state text,
    old_trigger_id integer, new_trigger_id integer,
    next_method text, next_kwargs jsonb, trigger_timeout timestamptz,
    txid bigint NOT NULL
);
CREATE INDEX ti_audit_ti ON chaos.ti_audit (ti_id);
CREATE FUNCTION chaos.audit_ti() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    op text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO chaos.ti_audit (ti_id, at, op, old_state, old_trigger_id, txid)
        VALUES (OLD.id, clock_timestamp(), 'deleted', OLD.state, OLD.trigger_id, txid_current());
        RETURN OLD;
    END IF;
    IF NEW.state = 'deferred' AND OLD.state IS DISTINCT FROM 'deferred' THEN
        op := 'deferred';
    ELSIF OLD.state = 'deferred' AND NEW.state IS DISTINCT FROM 'deferred' THEN
        op := 'resolved';
    ELSIF NEW.state IS DISTINCT FROM 'deferred' AND (OLD.next_method IS DISTINCT FROM NEW.next_method
            OR OLD.next_kwargs::text IS DISTINCT FROM NEW.next_kwargs::text) THEN
        op := 'rewritten';
    ELSE
        RETURN NEW;
    END IF;
    INSERT INTO chaos.ti_audit (ti_id, at, op, old_state, new_state, old_trigger_id, new_trigger_id,
                                next_method, next_kwargs, trigger_timeout, txid)
    VALUES (NEW.id, clock_timestamp(), op, OLD.state, NEW.state, OLD.trigger_id, NEW.trigger_id,
            NEW.next_method, to_jsonb(NEW.next_kwargs), NEW.trigger_timeout, txid_current());
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_ti_audit AFTER UPDATE OR DELETE ON task_instance
    FOR EACH ROW EXECUTE FUNCTION chaos.audit_ti();
CREATE TABLE chaos.asset_event_audit (event_id integer PRIMARY KEY, at timestamptz NOT NULL, txid bigint,
                                      app text);
CREATE FUNCTION chaos.audit_asset_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.asset_event_audit (event_id, at, txid, app)
    VALUES (NEW.id, clock_timestamp(), txid_current(), current_setting('application_name'));
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_asset_event_audit AFTER INSERT ON asset_event
    FOR EACH ROW EXECUTE FUNCTION chaos.audit_asset_event();
"""

ASSET_DAG_FILE = '''
"""Chaos run: assets fed by status-table watchers; the consumer only makes them active (no scheduler)."""
import functools
import operator

import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset, AssetWatcher
from dataset_bridge import TableStatusTrigger
from tests.helpers.chaos_triggers import SourceWatchTrigger


def watched(k):
    trigger = TableStatusTrigger(conn_id="warehouse", table_name=f"asset.a{{k}}", status_table={status!r},
                                 start_from="earliest", poll_interval={poll!r},
                                 notify_channel={channel!r} if k % 2 == 0 else None)
    return Asset(f"chaos://status/a{{k}}", watchers=[AssetWatcher(name=f"a{{k}}_loaded", trigger=trigger)])


# one event whose extra jsonb cannot hold (the source answers it with a NUL in a string)
nul = Asset({nul_uri!r}, watchers=[AssetWatcher(
    name="nul_extra",
    trigger=SourceWatchTrigger(url={source_url!r}, key={nul_key!r}, poll_interval={poll!r}))])

with DAG(dag_id={dag_id!r},
         schedule=functools.reduce(operator.or_, [watched(k) for k in range({count})] + [nul]),
         start_date=pendulum.datetime(2024, 1, 1), catchup=False, is_paused_upon_creation=False):
    EmptyOperator(task_id="consume")
'''


def execute(dsn: str, sql: str, params: Any = None, *, fetch: bool = False, retry_for: float = 30.0) -> Any:
    """One statement in its own transaction, retried while PostgreSQL is unreachable (bounded)."""
    deadline = time.monotonic() + retry_for
    while True:
        try:
            conn = psycopg2.connect(dsn, connect_timeout=5)
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        try:
            with conn, conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall() if fetch else None
        finally:
            conn.close()


def db_now(dsn: str) -> dt.datetime:
    value: dt.datetime = execute(dsn, "SELECT clock_timestamp()", fetch=True)[0][0]
    return value


class Warehouse:
    """The harness's writes to the watched database: each flip records its time with the DB clock.

    One writer, one statement at a time: status-row ids follow commit order, as TableStatusTrigger needs.
    Flips are idempotent, so a retry after a dropped connection never writes a second condition.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def create(self, flags: Sequence[str]) -> None:
        execute(self.dsn, WAREHOUSE_DDL)
        if flags:
            execute(self.dsn, "INSERT INTO chaos.flags (name) SELECT unnest(%s::text[])", (list(flags),))

    def flip(self, ident: Identity, source: KeySource) -> None:
        if ident.kind == TABLE:
            execute(self.dsn, f"INSERT INTO {STATUS_TABLE} (table_name, status) SELECT %(t)s, 'SUCCESS' "
                              f"WHERE NOT EXISTS (SELECT 1 FROM {STATUS_TABLE} WHERE table_name = %(t)s "
                              f"AND status = 'SUCCESS'); NOTIFY {LOAD_CHANNEL}", {"t": ident.name})
        elif ident.kind == FLAG:
            execute(self.dsn, "UPDATE chaos.flags SET value = true, flipped_at = clock_timestamp() "
                              f"WHERE name = %s AND NOT value; NOTIFY {FLAG_CHANNEL}", (ident.name,))
        else:
            # recorded first, then served: the recorded time is never later than the real flip
            execute(self.dsn, "INSERT INTO chaos.http_flip (key, at) VALUES (%s, clock_timestamp()) "
                              "ON CONFLICT DO NOTHING", (ident.name,))
            if ident.kind == POISON:
                source.events[ident.name] = {"key": ident.name, "note": NUL_NOTE}
            source.ready.add(ident.name)

    def status_row(self, table_name: str, status: str) -> None:
        execute(self.dsn, f"INSERT INTO {STATUS_TABLE} (table_name, status) VALUES (%s, %s); "
                          f"NOTIFY {ASSET_CHANNEL}", (table_name, status))

    def condition_times(self) -> dict[str, dt.datetime]:
        """When each table, flag and HTTP key flipped, by name."""
        found: dict[str, dt.datetime] = {}
        queries = (f"SELECT table_name, min(created_dttm) FROM {STATUS_TABLE} "
                   "WHERE status = 'SUCCESS' AND table_name LIKE 'load.%' GROUP BY table_name",
                   "SELECT name, flipped_at FROM chaos.flags WHERE value",
                   "SELECT key, at FROM chaos.http_flip")
        for query in queries:
            found.update({r[0]: r[1] for r in execute(self.dsn, query, fetch=True)})
        return found

    def asset_rows(self) -> list[tuple[int, str, str, dt.datetime]]:
        return [(int(r[0]), r[1], r[2], r[3]) for r in execute(
            self.dsn, f"SELECT id, table_name, status, created_dttm FROM {STATUS_TABLE} "
                      "WHERE table_name LIKE 'asset.%' ORDER BY id", fetch=True)]


# --------------------------------------------------------------------------------------------------
# The HTTP condition source PollTrigger polls.
# --------------------------------------------------------------------------------------------------


class KeySource:
    """``GET /poll/{key}`` answers ``{"ready": bool}``; a key is ready once the harness flipped it. A key
    with an event of its own (the poison, the NUL extra) answers it too: ``chaos_triggers`` yields it.

    ``POST /inbox`` is the relay's target: it checks the signature as the bridge's inbox does, answers
    "created" (or "duplicate") per event and counts the deliveries of each asset event id.
    """

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.events: dict[str, dict[str, Any]] = {}
        self.polls = 0
        self.port = 0
        self.secret = os.urandom(16).hex()
        self.received: Counter[int] = Counter()
        self.inbox_refusals = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _poll(self, request: web.Request) -> web.Response:
        self.polls += 1
        key = request.match_info["key"]
        if key not in self.ready:
            return web.json_response({"ready": False})
        return web.json_response({"ready": True, "event": self.events.get(key, {"key": key})})

    async def _inbox(self, request: web.Request) -> web.Response:
        from dataset_bridge import signing

        body = await request.read()
        try:
            signing.verify({BRIDGE_SOURCE: self.secret}, {k.lower(): v for k, v in request.headers.items()},
                           body)
        except signing.SignatureError as err:
            self.inbox_refusals += 1
            return web.json_response({"detail": str(err)}, status=401)
        results = []
        for event in json.loads(body)["events"]:
            event_id = int(event["id"])
            results.append({"id": event_id, "status": "duplicate" if self.received[event_id] else "created"})
            self.received[event_id] += 1
        return web.json_response({"results": results})

    @contextlib.contextmanager
    def running(self) -> Iterator[KeySource]:
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/poll/{key}", self._poll)
        app.router.add_post("/inbox", self._inbox)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        loop.run_until_complete(site.start())
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        thread = threading.Thread(target=loop.run_forever, name="chaos-key-source", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


# --------------------------------------------------------------------------------------------------
# The cluster: instances and PostgreSQL, and the faults done to them.
# --------------------------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    kind: str
    slot: str
    started: dt.datetime
    ended: dt.datetime | None = None
    note: str = ""  # what the fault did (a frozen backend's state, a step's size, whether an error landed)
    effective: bool = True  # False: the fault could not be made as planned (see note)


def _wall() -> dt.datetime:
    """The host clock, which the local PostgreSQL's clock_timestamp() also reads (less its steps)."""
    return dt.datetime.now(dt.UTC)


JOB_ID = re.compile(STARTED_MARK + r".*?\bjob_id=(\d+)")
IN_TRANSACTION = ("SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                  "AND datname = current_database() AND xact_start IS NOT NULL "
                  "AND state IN ('active', 'idle in transaction')")
LEASE_EXPIRY = "SELECT max(expires_at) FROM smart_triggerer.shard_lease WHERE owner_job_id = %s"
TERMINATE = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s "
             "AND datname = current_database() AND pid <> pg_backend_pid()")
DB_UNAVAILABLE = "database unavailable"


class Cluster:
    """The smart triggerer instances (by slot), the relay, and the PostgreSQL server under them.

    Each instance reaches the metadata database through its slot's proxy and names its sessions after
    itself (``PGAPPNAME``, which libpq reads: Airflow's psycopg2 connections carry it). Signals go to one
    instance's process group (Component.signal), never by name. A slot that is not deliberately down and
    whose process exited is an unexpected exit: recorded and restarted.
    """

    def __init__(self, stack: AirflowStack, server: EmbeddedPostgres, log: Log, proxies: Proxies,
                 lease_seconds: float) -> None:
        self.stack, self.server, self.log, self.proxies = stack, server, log, proxies
        self.lease_seconds = lease_seconds
        self.slots: dict[str, Component] = {}
        self.down: set[str] = set()
        self.paused: set[str] = set()
        self.frozen: set[str] = set()
        self.generation: Counter[str] = Counter()
        self.unexpected_exits: list[str] = []
        self.startup_exits: list[str] = []
        self.unclean_stops: list[str] = []
        self.stopping: list[tuple[Component, float, float]] = []  # (component, signalled, deadline)
        self.term_exit_seconds: list[float] = []
        self.relay: Component | None = None
        self.relay_args: list[str] = []

    @property
    def dsn(self) -> str:
        return self.stack.config.database_dsn

    def start(self, slot: str) -> Component:
        self.generation[slot] += 1
        name = slot if self.generation[slot] == 1 else f"{slot}.{self.generation[slot]}"
        proxy = self.proxies.get(slot)
        through = re.sub(r"@127\.0\.0\.1:\d+/", f"@127.0.0.1:{proxy.port}/", self.dsn)
        env = {"PGAPPNAME": name, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(through)}
        component = self.stack.start_smart_triggerer(name, env=env)
        self.slots[slot] = component
        self.down.discard(slot)
        return component

    def start_relay(self, args: list[str]) -> None:
        """The dataset bridge's relay (outbox -> the inbox stub); watched like the instances."""
        self.relay_args = args
        self.relay = self.stack.add_relay(args)

    def kill(self, slot: str) -> None:
        """SIGKILL the instance's process group and wait for it to be gone."""
        component = self.slots[slot]
        self.down.add(slot)
        component.signal(signal.SIGKILL)
        assert component.process is not None
        component.process.wait(10)
        self.paused.discard(slot)
        self.frozen.discard(slot)

    def terminate(self, slot: str, grace: float = 30.0) -> None:
        """SIGTERM the instance's process group without waiting: its exit is reaped by ``watch``.

        A graceful stop releases the leases at once but the process may take a while to exit; the
        timeline of flips and faults must not wait for it.
        """
        component = self.slots.pop(slot)
        self.down.discard(slot)
        component.signal(signal.SIGTERM)
        self.stopping.append((component, time.monotonic(), time.monotonic() + grace))

    def reap(self) -> None:
        """Exit codes of gracefully stopped instances; one that ignores SIGTERM past its grace is killed."""
        for entry in list(self.stopping):
            component, since, deadline = entry
            assert component.process is not None
            code = component.process.poll()
            if code is None and time.monotonic() < deadline:
                continue
            self.stopping.remove(entry)
            if code is None:
                self.unclean_stops.append(f"{component.name} still running {deadline - since:.0f}s after "
                                          "SIGTERM; killed")
                component.signal(signal.SIGKILL)
                component.process.wait(10)
                continue
            self.term_exit_seconds.append(time.monotonic() - since)
            if code != 0:
                self.unclean_stops.append(f"{component.name} exited with {code} on SIGTERM")

    def pause(self, slot: str) -> None:
        self.paused.add(slot)
        self.slots[slot].signal(signal.SIGSTOP)

    def unpause(self, slot: str) -> None:
        self.slots[slot].signal(signal.SIGCONT)
        self.paused.discard(slot)

    def freeze(self, slot: str, within: float = 20.0) -> tuple[bool, str]:
        """SIGSTOP the instance at a moment one of its sessions is inside a transaction, for good.

        A session seen inside a transaction may be running its COMMIT: after the stop, once no session of
        the instance is still 'active', one must be 'idle in transaction' (its client stopped before it
        could end it), else the instance is woken and caught again.
        """
        component = self.slots[slot]
        conn = psycopg2.connect(self.dsn, connect_timeout=5)
        conn.autocommit = True
        deadline = time.monotonic() + within
        try:
            with conn.cursor() as cur:
                while time.monotonic() < deadline:
                    cur.execute(IN_TRANSACTION, (component.name,))
                    pids = [r[0] for r in cur.fetchall()]
                    if not pids:
                        time.sleep(0.002)
                        continue
                    component.signal(signal.SIGSTOP)
                    states = _settled(cur, component.name)
                    held = [pid for pid, state in states if state == "idle in transaction"]
                    if held:
                        self.frozen.add(slot)
                        return True, f"backend {held[0]} idle in transaction ({len(states)} sessions)"
                    component.signal(signal.SIGCONT)
        finally:
            conn.close()
        component.signal(signal.SIGSTOP)
        self.frozen.add(slot)
        return False, f"no session seen inside a transaction in {within:.0f}s: frozen outside one"

    def job_of(self, component: Component, within: float = 60.0) -> int:
        """The instance's job id, from its start-up line (waited for, bounded)."""
        from tests.helpers.waiting import wait_for

        found = wait_for(lambda: JOB_ID.search(_log_head(component)), bool, within,
                         f"{component.name} to log its start", 0.1)
        assert found is not None
        return int(found.group(1))

    def db_error(self, slot: str, window: float) -> tuple[bool, str]:
        """Right after the instance renewed its leases, make its statements fail for ``window`` seconds.

        The renewal is seen as its lease rows' expiry moving on (the claim committed). Then every session
        it has in the metadata database is terminated, again and again: a session closed while idle is
        replaced by the pool's pre-ping, so the window lasts until the error reached the loop (its log says
        "database unavailable"), at most ``window`` + 5 s.
        """
        component = self.slots[slot]
        job = self.job_of(component)
        offset = component.log_path.stat().st_size
        conn = psycopg2.connect(self.dsn, connect_timeout=5)
        conn.autocommit = True
        renewed = False
        killed = 0
        try:
            with conn.cursor() as cur:
                last = None
                deadline = time.monotonic() + 3 * self.lease_seconds
                while time.monotonic() < deadline:
                    cur.execute(LEASE_EXPIRY, (job,))
                    expiry = cur.fetchone()[0]
                    if last is not None and expiry is not None and expiry > last:
                        renewed = True
                        break
                    last = expiry
                    time.sleep(0.002)
                until, latest = time.monotonic() + window, time.monotonic() + window + 5.0
                reached, looked = False, 0.0
                while time.monotonic() < latest:
                    cur.execute(TERMINATE, (component.name,))
                    killed += cur.fetchone()[0]
                    if time.monotonic() >= until and time.monotonic() - looked > 0.05:
                        looked = time.monotonic()
                        reached = DB_UNAVAILABLE in _log_since(component, offset)
                        if reached:
                            break
                    time.sleep(0.001)
        finally:
            conn.close()
        how = "after a lease renewal" if renewed else f"NO renewal seen in {3 * self.lease_seconds:.0f}s"
        landed = "the error reached its loop" if reached else "NO error reached its loop"
        return reached and renewed, f"{how}; {killed} sessions terminated; {landed}"

    def watch(self) -> None:
        """Restart any instance that exited on its own, as a process supervisor would.

        An instance that was up (it logged ``smart triggerer started``) and exited is a product failure.
        One that exited before that, while the database was unreachable, is reported apart: Airflow's own
        job start-up (``run_job``) gives up when it cannot create its job row. The relay is watched alike.
        """
        self.reap()
        for slot, component in list(self.slots.items()):
            if slot in self.down or component.running():
                continue
            code = component.process.returncode if component.process else None
            text = component.log_tail(20_000)
            tail = " | ".join(line.strip() for line in text.strip().splitlines()[-6:])
            found = self.unexpected_exits if STARTED_MARK in _log_head(component) else self.startup_exits
            found.append(f"{component.name} exited with {code}: {tail}")
            self.log(f"{component.name} exited on its own ({code}); restarting it")
            self.start(slot)
        if self.relay is not None and not self.relay.running():
            code = self.relay.process.returncode if self.relay.process else None
            tail = " | ".join(line.strip() for line in self.relay.log_tail(4000).strip().splitlines()[-6:])
            self.unexpected_exits.append(f"relay exited with {code}: {tail}")
            self.log(f"the relay exited on its own ({code}); restarting it")
            self.stack.components.remove(self.relay)
            self.relay = self.stack.add_relay(self.relay_args)

    def release(self) -> None:
        """Wake every paused instance (a stopped process cannot act on SIGTERM), kill the frozen ones
        (never woken), heal every partition."""
        for slot in list(self.paused):
            self.unpause(slot)
        for slot in list(self.frozen):
            self.kill(slot)
        for slot in list(self.proxies.by_name):
            self.proxies.heal(slot)


def _log_head(component: Component, size: int = 4_000_000) -> str:
    """The start of a component's log (its start-up lines), however long it has grown since."""
    if not component.log_path.exists():
        return ""
    with component.log_path.open("rb") as log:
        return log.read(size).decode(errors="replace")


def _log_since(component: Component, offset: int) -> str:
    with component.log_path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _settled(cur: Any, application: str, within: float = 2.0) -> list[tuple[int, str]]:
    """The instance's sessions once none is 'active' any more (its process stopped: each statement in
    flight finishes and the session waits for its client), bounded."""
    deadline = time.monotonic() + within
    while True:
        cur.execute("SELECT pid, state FROM pg_stat_activity WHERE application_name = %s "
                    "AND datname = current_database()", (application,))
        states = [(int(r[0]), str(r[1])) for r in cur.fetchall()]
        if all(state != "active" for _pid, state in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.005)


# --------------------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------------------


@dataclass(order=True)
class Action:
    at: float
    seq: int
    label: str = field(compare=False)
    run: Callable[[], None] = field(compare=False)


@dataclass
class Observed:
    """Everything the checker needs, read from the databases after the run."""

    audit: dict[str, list[dict[str, Any]]]
    final: dict[str, tuple[str | None, int | None]]  # ti id -> (state, trigger id)
    stuck: dict[str, str]  # ti id -> where its trigger stands (shard, owner), for lost waiters
    conditions: dict[str, dt.datetime]
    asset_rows: list[tuple[int, str, str, dt.datetime]]
    asset_events: list[tuple[int, str, dict[str, Any], dt.datetime | None]]
    t0: dt.datetime
    diagnostics: list[str] = field(default_factory=list)  # state to explain a failure with
    watchers: dict[str, int] = field(default_factory=dict)  # asset uri -> its watcher's trigger id
    clock_steps: list[ClockStep] = field(default_factory=list)  # the database clock's forward steps
    outbox: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # event id -> status, error
    delivered: Counter[int] = field(default_factory=Counter)  # event id -> deliveries to the inbox stub
    # status row id -> instance process (its log's name: smart-3.13 is slot smart-3's 13th start) -> when
    # its watcher first fired the row's event (host clock, its log's "Trigger fired event" line)
    fired_by: dict[int, dict[str, dt.datetime]] = field(default_factory=dict)
    stored_by: dict[int, str] = field(default_factory=dict)  # asset event id -> the process that stored it


class ChaosRun:
    """Sets everything up, runs the timeline of flips, rows and faults, waits for quiescence, checks."""

    def __init__(self, profile: Profile, log: Log = print, keep_logs: Path | None = None) -> None:
        self.profile = profile
        self.plan = make_plan(profile)
        self.log = log
        self.keep_logs = keep_logs
        self.faults: list[FaultRecord] = []
        self.notes: list[str] = []
        self.t0_db = _wall()
        self.started = self.chaos_start = time.monotonic()
        self.chaos_seconds = 0.0
        self.stopped = False
        self.clock_steps: list[ClockStep] = []

    # --- the whole run ---

    def run(self) -> Report:
        self.log(self.plan.describe())
        library = ensure_libfaketime(self.log)
        root = Path(tempfile.mkdtemp(prefix="smart-triggerer-chaos-"))
        try:
            with contextlib.ExitStack() as resources:
                server = FakeClockPostgres(root / "pgdata", library=library)
                server.start()
                resources.callback(server.stop)
                self.server = server
                source = resources.enter_context(KeySource().running())
                self.proxies = resources.enter_context(Proxies(("127.0.0.1", server.port)).running())
                return self._run_on(server, source, root, resources)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run_on(self, server: EmbeddedPostgres, source: KeySource, root: Path,
                resources: contextlib.ExitStack) -> Report:
        self.source = source
        airflow_dsn, warehouse_dsn = self._databases(server, root)
        self.airflow_dsn = airflow_dsn
        self.warehouse = Warehouse(warehouse_dsn)
        self.warehouse.create([i.name for i in self.plan.identities if i.kind == FLAG])
        routes = self._routes(root)
        stack = AirflowStack(self._config(root, airflow_dsn, warehouse_dsn, routes))
        stack.config.dags_folder.mkdir(parents=True, exist_ok=True)
        self.stack = stack
        cluster = Cluster(stack, server, self.log, self.proxies, self.profile.lease_seconds)
        self.cluster = cluster
        resources.callback(self._stop_everything)
        self._sync_assets()
        self._bridge(routes)
        self._seed_wave(0)
        for n in range(self.profile.instances):
            cluster.start(f"smart-{n + 1}")
        self._wait_loaded()
        self._chaos()
        self._finish()
        diagnostics, watchers = self._diagnostics()
        self._stop_everything()
        observed = self._observe(diagnostics)
        observed.watchers = watchers
        report = check(self.plan, observed, self.faults, self._figures_in())
        if not report.ok:
            report.evidence = self._evidence(report.trigger_ids, report.row_ids)
        return report

    def _databases(self, server: EmbeddedPostgres, root: Path) -> tuple[str, str]:
        self.log("migrating a fresh Airflow metadata database")
        airflow_dsn = create_database(server.dsn, "chaos_airflow")
        migrate(AirflowConfig(home=root / "migrate", database_dsn=airflow_dsn, dags_folder=root / "dags",
                              fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"]))
        execute(airflow_dsn, AUDIT_DDL)
        return airflow_dsn, create_database(server.dsn, "chaos_warehouse")

    def _routes(self, root: Path) -> Path:
        """The bridge's routes: every chaos asset to the inbox stub."""
        assets = [f"chaos://status/a{k}" for k in range(self.profile.assets)] + [NUL_ASSET]
        path = root / "routes.json"
        path.write_text(json.dumps({"source": BRIDGE_SOURCE, "targets": {SINK: {
            "url": f"{self.source.url}/inbox", "secret_env": SINK_SECRET_ENV, "assets": assets}}}))
        return path

    def _bridge(self, routes: Path) -> None:
        """``dataset-bridge init --routes`` (before any event, as the README says), then the relay."""
        import subprocess
        import sys

        command = [str(Path(sys.executable).with_name("dataset-bridge")), "init", "--routes", str(routes)]
        result = subprocess.run(command, env=self.stack.config.env(), capture_output=True, text=True,
                                timeout=300, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"dataset-bridge init failed ({result.returncode}): {result.stderr[-3000:]}")
        self.cluster.start_relay(["--routes", str(routes)])

    def _config(self, root: Path, airflow_dsn: str, warehouse_dsn: str, routes: Path) -> AirflowConfig:
        home = root / "airflow"
        home.mkdir()
        extra = {
            "PYTHONPATH": str(ROOT),
            "AIRFLOW_CONN_WAREHOUSE": warehouse_dsn,
            # the instances write the bridge's outbox rows in the transaction that creates each event
            "AIRFLOW__CORE__ASSET_MANAGER_CLASS": "dataset_bridge.asset_manager.OutboxAssetManager",
            "AIRFLOW__CORE__ASSET_MANAGER_KWARGS": json.dumps({"routes": str(routes)}),
            SINK_SECRET_ENV: self.source.secret,
            "AIRFLOW__SMART_TRIGGERER__SHARDS": str(self.profile.shards),
            "AIRFLOW__SMART_TRIGGERER__LEASE_SECONDS": str(self.profile.lease_seconds),
            # seeded waiters are resumed by nobody else: the 3.3.2 race guard would only delay them
            "AIRFLOW__SMART_TRIGGERER__RESUME_HOLD_SECONDS": "0",
        }
        return AirflowConfig(home=home, database_dsn=airflow_dsn, dags_folder=root / "dags",
                             fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"], extra=extra)

    def _stop_everything(self) -> None:
        """Every process this run started, stopped (idempotent; also runs on errors)."""
        if getattr(self, "cluster", None) is None or self.stopped:
            return
        self.stopped = True
        self.cluster.release()
        self.cluster.down.update(self.cluster.slots)
        try:
            self.stack.stop()
        finally:
            self.cluster.reap()
            if self.keep_logs is not None:
                shutil.copytree(self.stack.log_dir, self.keep_logs, dirs_exist_ok=True)

    # --- setup ---

    def _sync_assets(self) -> None:
        from tests.helpers.airflow_orm import use_airflow_db
        from tests.helpers.seeding import _sync_dag

        p = self.profile
        path = self.stack.config.dags_folder / f"{ASSET_DAG}.py"
        path.write_text(textwrap.dedent(ASSET_DAG_FILE.format(
            status=STATUS_TABLE, poll=p.asset_poll, channel=ASSET_CHANNEL, dag_id=ASSET_DAG, count=p.assets,
            nul_uri=NUL_ASSET, source_url=self.source.url, nul_key=NUL_KEY)))
        use_airflow_db(self.airflow_dsn)
        _sync_dag(path, self.stack.config.dags_folder)
        watchers = execute(self.airflow_dsn, "SELECT count(*) FROM asset_watcher w JOIN asset a "
                                             "ON a.id = w.asset_id WHERE a.uri LIKE 'chaos://%'", fetch=True)
        if watchers[0][0] != p.assets + 1:
            raise RuntimeError(f"expected {p.assets + 1} asset watchers, Airflow created {watchers[0][0]}")

    def _seed_wave(self, wave: int) -> None:
        from tests.helpers.seeding import seed_deferred

        for kind, classpath in CLASSPATHS.items():
            members = [w for w in self.plan.waiters if w.wave == wave and w.identity.kind == kind]
            if not members:
                continue
            seeded = seed_deferred(
                self.airflow_dsn, self.stack.config.dags_folder, count=len(members), classpath=classpath,
                kwargs_for=partial(_kwargs_of, members, self.source.url), dag_id=f"chaos_w{wave}_{kind}")
            for map_index, (waiter, ti_id) in enumerate(zip(members, seeded.ti_ids, strict=True)):
                waiter.ti_id, waiter.dag_id, waiter.map_index = ti_id, seeded.dag_id, map_index
        self.log(f"seeded wave {wave + 1}: {sum(1 for w in self.plan.waiters if w.wave == wave)} waiters")

    def _wait_loaded(self) -> None:
        """Start the clock once every first-wave trigger row is claimed by an instance (bounded)."""
        from tests.helpers.waiting import wait_for

        def unclaimed() -> int:
            self.cluster.watch()
            return int(execute(self.airflow_dsn, "SELECT count(*) FROM trigger t JOIN task_instance ti "
                                                 "ON ti.trigger_id = t.id WHERE t.triggerer_id IS NULL",
                               fetch=True)[0][0])

        wait_for(unclaimed, lambda n: n == 0, 240, "every first-wave waiter claimed by an instance", 0.5)

    # --- the timeline ---

    def _chaos(self) -> None:
        self.t0_db = db_now(self.airflow_dsn)
        self._set_timeouts()
        actions = self._actions()
        self.log(f"chaos phase: {self.profile.seconds:.0f}s, {len(actions)} actions")
        start = self.chaos_start = time.monotonic()
        next_progress = 0.0
        for action in sorted(actions):
            while (now := time.monotonic() - start) < action.at:
                self.cluster.watch()
                if now >= next_progress:
                    self._progress(now)
                    next_progress = now + 10
                time.sleep(min(0.2, action.at - now))
            action.run()
        self.chaos_seconds = time.monotonic() - start

    def _set_timeouts(self) -> None:
        timed = [w for w in self.plan.waiters if w.timeout_at is not None]
        if timed:
            execute(self.airflow_dsn,
                    "UPDATE task_instance ti SET trigger_timeout = %s + make_interval(secs => v.offs) "
                    "FROM unnest(%s::uuid[], %s::float8[]) AS v(id, offs) WHERE ti.id = v.id",
                    (self.t0_db, [w.ti_id for w in timed], [w.timeout_at for w in timed]))

    def _actions(self) -> list[Action]:
        seq = iter(range(1_000_000))
        flip = self.warehouse.flip
        # the poison group's condition is its fault
        actions = [Action(i.flip_at, next(seq), f"flip {i.name}", partial(flip, i, self.source))
                   for i in self.plan.identities if i.kind != POISON]
        actions += [Action(at, next(seq), f"row {t} {s}", partial(self.warehouse.status_row, t, s))
                    for at, t, s in self.plan.rows]
        actions.append(Action(self.plan.wave_at, next(seq), "wave 2", partial(self._seed_wave, 1)))
        for fault in self.plan.faults:
            record = FaultRecord(fault.kind, fault.slot, _wall())
            actions.append(Action(fault.at, next(seq), f"{fault.kind} {fault.slot}",
                                  partial(self._fault_start, fault, record)))
            actions.append(Action(fault.at + fault.hold, next(seq), f"end {fault.kind} {fault.slot}",
                                  partial(self._fault_end, fault, record)))
        return actions

    def _fault_start(self, fault: FaultPlan, record: FaultRecord) -> None:
        record.started = _wall()
        self.faults.append(record)
        cluster = self.cluster
        simple: dict[str, Callable[[str], object]] = {
            "sigkill": cluster.kill, "sigstop": cluster.pause, "sigterm": cluster.terminate,
            "leave": cluster.terminate, "join": cluster.start, "partition": self.proxies.partition}
        if fault.kind in simple:
            simple[fault.kind](fault.slot)
        elif fault.kind == "pg_restart":
            cluster.server.restart(down_seconds=fault.hold)
            record.ended = _wall()  # accepting connections again: the end of its downtime
        elif fault.kind == "freeze":
            try:
                record.effective, record.note = cluster.freeze(fault.slot)
            except psycopg2.Error as err:  # pg_stat_activity out of reach: frozen wherever it was
                cluster.pause(fault.slot)
                cluster.paused.discard(fault.slot)
                cluster.frozen.add(fault.slot)
                record.effective, record.note = False, f"frozen without looking: {err}"[:300]
        else:
            self._instant_fault(fault, record)
        elapsed = time.monotonic() - self.chaos_start
        note = f": {record.note}" if record.note else ""
        self.log(f"  {elapsed:6.1f}s fault {fault.kind} {fault.slot}{note}")

    def _instant_fault(self, fault: FaultPlan, record: FaultRecord) -> None:
        """Faults that are over once made: a DB error window, a clock step, the poison, the NUL extra."""
        if fault.kind == "db_error":
            try:
                made = self.cluster.db_error(fault.slot, self.profile.db_error_seconds)
                record.effective, record.note = made
            except (AssertionError, psycopg2.Error) as err:  # not started in time, the database away
                record.effective, record.note = False, f"not made: {err}"[:300]
        elif fault.kind == "clock_step":
            self.clock_steps.append(self.server.step(fault.hold))
            record.note = f"database clock +{fault.hold:.1f}s"
        elif fault.kind == "poison":
            poison = next(i for i in self.plan.identities if i.kind == POISON)
            self.warehouse.flip(poison, self.source)
            record.note = f"{POISON_MEMBERS} waiters of {poison.name}"
        elif fault.kind == "nul_extra":
            self.source.events[NUL_KEY] = {"key": NUL_KEY, "note": NUL_NOTE, "idempotency_key": "chaos/nul/1"}
            self.source.ready.add(NUL_KEY)
            record.note = f"the watcher of {NUL_ASSET}"
        record.ended = _wall()

    def _fault_end(self, fault: FaultPlan, record: FaultRecord) -> None:
        if fault.kind in ("sigkill", "sigterm"):
            self.cluster.start(fault.slot)
        elif fault.kind == "sigstop":
            self.cluster.unpause(fault.slot)
        elif fault.kind == "freeze":
            # never woken: killed and replaced in its slot, as an orchestrator would
            self.cluster.kill(fault.slot)
            self.cluster.start(fault.slot)
        elif fault.kind == "partition":
            self.proxies.heal(fault.slot)
        if record.ended is None:
            record.ended = _wall()

    def _progress(self, elapsed: float) -> None:
        with contextlib.suppress(psycopg2.Error):
            found = execute(self.airflow_dsn, "SELECT count(*) FILTER (WHERE op = 'resolved'), "
                                              "(SELECT count(*) FROM chaos.asset_event_audit) "
                                              "FROM chaos.ti_audit", fetch=True, retry_for=0)[0]
            self.log(f"  {elapsed:6.1f}s faults {len(self.faults)}, resolved {found[0]}/"
                     f"{len(self.plan.waiters)}, asset events {found[1]}, polls {self.source.polls}")

    # --- the end ---

    def _finish(self) -> None:
        """All conditions hold by now; wait (bounded) until nothing waits and every row has its event."""
        from tests.helpers.waiting import wait_for

        self.cluster.release()
        success_rows = sum(1 for _at, _t, status in self.plan.rows if status == "SUCCESS")
        worst = self.profile.bound(max(*self.profile.polls, self.profile.push_poll))

        def pending() -> tuple[int, int, int, int]:
            self.cluster.watch()
            found = execute(self.airflow_dsn, "SELECT (SELECT count(*) FROM task_instance WHERE state = "
                                              "'deferred'), (SELECT count(*) FROM chaos.asset_event_audit), "
                                              "(SELECT count(*) FROM dataset_bridge.outbox WHERE status = "
                                              "'pending'), (SELECT count(*) FROM dataset_bridge.outbox "
                                              "WHERE status = 'dead')", fetch=True)[0]
            return int(found[0]), int(found[1]), int(found[2]), int(found[3])

        try:
            # the NUL extra's event too, and its dead letter (the relay sweeps every 10 s)
            wait_for(pending, lambda v: v[0] == 0 and v[1] >= success_rows + 1 and v[2] == 0 and v[3] >= 1,
                     worst + 60, "quiescence (no deferred waiter, one event per SUCCESS row and the NUL "
                                 "extra's, nothing left to relay, the NUL extra's event dead-lettered)", 0.5)
        except AssertionError as err:
            self.notes.append(str(err))
            self.log(str(err))
        # Not for correctness: gives a fenced-out writer the chance to show a late second write.
        time.sleep(self.profile.lease_seconds)

    def _observe(self, diagnostics: list[str]) -> Observed:
        dsn = self.airflow_dsn
        audit: dict[str, list[dict[str, Any]]] = {}
        columns = ("ti_id", "at", "op", "new_state", "old_trigger_id", "next_method", "next_kwargs",
                   "trigger_timeout", "txid")
        for row in execute(dsn, f"SELECT {', '.join(columns)} FROM chaos.ti_audit ORDER BY seq", fetch=True):
            entry = dict(zip(columns, row, strict=True))
            audit.setdefault(str(entry["ti_id"]), []).append(entry)
        final = {str(r[0]): (r[1], r[2]) for r in execute(
            dsn, "SELECT id, state, trigger_id FROM task_instance WHERE dag_id LIKE 'chaos_w%'", fetch=True)}
        found = execute(
            dsn, "SELECT e.id, a.uri, e.extra, au.at, au.app "
                 "FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                 "LEFT JOIN chaos.asset_event_audit au ON au.event_id = e.id "
                 "WHERE a.uri LIKE 'chaos://%' ORDER BY e.id", fetch=True)
        events = [(int(r[0]), r[1], _as_dict(r[2]), r[3]) for r in found]
        stored_by = {int(r[0]): r[4] for r in found if r[4]}
        outbox = {int(r[0]): (str(r[1]), r[2]) for r in execute(
            dsn, "SELECT asset_event_id, status, last_error FROM dataset_bridge.outbox WHERE target = %s",
            (SINK,), fetch=True)}
        return Observed(audit, final, self._stuck(final), self.warehouse.condition_times(),
                        self.warehouse.asset_rows(), events, self.t0_db, diagnostics,
                        clock_steps=list(self.clock_steps), outbox=outbox,
                        delivered=Counter(self.source.received), fired_by=fired_by(self.stack.log_dir),
                        stored_by=stored_by)

    def _diagnostics(self) -> tuple[list[str], dict[str, int]]:
        """Taken before the instances stop: where each asset watcher runs, instances, status watermarks."""
        watchers = execute(
            self.airflow_dsn,
            "SELECT a.uri, w.trigger_id, t.triggerer_id, i.shard, l.owner_job_id, l.expires_at > now() "
            "FROM asset_watcher w JOIN asset a ON a.id = w.asset_id JOIN trigger t ON t.id = w.trigger_id "
            "LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id "
            "LEFT JOIN smart_triggerer.shard_lease l ON l.shard = i.shard ORDER BY a.uri", fetch=True)
        found = [f"watcher {r[0]}: trigger {r[1]} triggerer_id={r[2]} shard={r[3]} lease owner={r[4]} "
                 f"live={r[5]}" for r in watchers]
        instances = execute(self.airflow_dsn, "SELECT job_id, now() - heartbeat_at, waiters, groups "
                                              "FROM smart_triggerer.instance WHERE stopped_at IS NULL AND "
                                              "heartbeat_at > now() - interval '30 seconds' ORDER BY job_id",
                            fetch=True)
        found += [f"live instance job {r[0]}: heartbeat age={r[1]} waiters={r[2]} groups={r[3]}"
                  for r in instances]
        # the NUL extra's event is left out: its extra cannot be cast to jsonb
        orphan_keys = execute(
            self.airflow_dsn,
            "SELECT k.asset_id, k.idempotency_key FROM smart_triggerer.asset_event_key k "
            "JOIN asset a ON a.id = k.asset_id AND a.uri LIKE 'chaos://status/%' WHERE NOT EXISTS "
            "(SELECT 1 FROM asset_event e WHERE e.asset_id = k.asset_id "
            "AND CAST(e.extra AS jsonb) -> 'payload' ->> 'idempotency_key' = k.idempotency_key)", fetch=True)
        found += [f"idempotency key claimed without an asset event: asset {r[0]} {r[1]}" for r in orphan_keys]
        with contextlib.suppress(psycopg2.Error):
            marks = execute(self.warehouse.dsn, "SELECT table_name, last_id, updated_at FROM "
                                                "dataset_bridge.status_watermark ORDER BY table_name",
                            fetch=True)
            found += [f"status watermark {r[0]}: last_id={r[1]} updated_at={r[2]}" for r in marks]
        return found, {r[0]: int(r[1]) for r in watchers}

    def _stuck(self, final: dict[str, tuple[str | None, int | None]]) -> dict[str, str]:
        """Where the trigger of each still-deferred waiter stands: its shard and the shard's lease."""
        ids = [t for ti, (state, t) in final.items() if state == "deferred" and t is not None]
        if not ids:
            return {}
        rows = execute(self.airflow_dsn,
                       "SELECT t.id, t.triggerer_id, i.shard, i.error, l.owner_job_id, l.expires_at "
                       "FROM trigger t LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id "
                       "LEFT JOIN smart_triggerer.shard_lease l ON l.shard = i.shard WHERE t.id = ANY(%s)",
                       (ids,), fetch=True)
        where = {r[0]: f"trigger {r[0]} triggerer_id={r[1]} shard={r[2]} identity_error={r[3]!r} "
                       f"lease owner={r[4]} expires={r[5]}" for r in rows}
        return {ti: where.get(t, f"trigger {t}") for ti, (state, t) in final.items()
                if state == "deferred" and t is not None}

    def _figures_in(self) -> dict[str, Any]:
        return {"chaos_seconds": self.chaos_seconds, "wall_seconds": time.monotonic() - self.started,
                "unexpected_exits": list(self.cluster.unexpected_exits),
                "startup_exits": list(self.cluster.startup_exits),
                "unclean_stops": list(self.cluster.unclean_stops), "notes": list(self.notes),
                "term_exit_seconds": list(self.cluster.term_exit_seconds),
                "polls": self.source.polls, "inbox_refusals": self.source.inbox_refusals}

    def _evidence(self, trigger_ids: set[int], row_ids: set[int], per_component: int = 12) -> list[str]:
        """Log lines that name a failing waiter's trigger or a lost status row, and each component's last
        errors (bounded)."""
        trigger = re.compile(r"\b(?:trigger_id|runner_id|trigger|ID)[=: ]+(\d+)\b")
        row = re.compile(r"'row_id': (\d+)")

        def names(line: str) -> bool:
            return (any(int(m) in trigger_ids for m in trigger.findall(line))
                    or any(int(m) in row_ids for m in row.findall(line)))

        lines: list[str] = []
        for log_file in sorted(self.stack.log_dir.glob("*.log")):
            text = log_file.read_text(errors="replace").splitlines()
            named = [ln for ln in text if names(ln)]
            errors = [ln for ln in text if "[error" in ln or "[critical" in ln]
            for line in named[:per_component] + errors[-3:]:
                lines.append(f"{log_file.stem}: {line[:400]}")
        return lines


FIRED_LINE = re.compile(r"^(\S+Z) .*Trigger fired event.*'row_id': (\d+)")


def fired_by(log_dir: Path) -> dict[int, dict[str, dt.datetime]]:
    """Which instance processes fired each status row's event, and when first (their logs' lines)."""
    fired: dict[int, dict[str, dt.datetime]] = {}
    for log_file in sorted(log_dir.glob("smart-*.log")):
        for line in log_file.read_text(errors="replace").splitlines():
            found = FIRED_LINE.search(line)
            if found:
                at = dt.datetime.fromisoformat(found.group(1).replace("Z", "+00:00"))
                by_process = fired.setdefault(int(found.group(2)), {})
                by_process[log_file.stem] = min(at, by_process.get(log_file.stem, at))
    return fired


def _kwargs_of(members: Sequence[Waiter], url: str, index: int) -> dict[str, Any]:
    return members[index].kwargs(url)


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------------------------------
# The checker: a pure function of what was planned and what the databases say.
# --------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Figures (label, value) for the table, every violation in words, and whether all checks passed."""

    figures: list[tuple[str, str]]
    violations: list[str]
    notes: list[str]
    trigger_ids: set[int] = field(default_factory=set)
    row_ids: set[int] = field(default_factory=set)
    evidence: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self, limit: int = 60) -> str:
        lines = [f"{label}: {value}" for label, value in self.figures]
        if self.violations:
            lines.append(f"{len(self.violations)} violations:")
            lines += [f"  {v}" for v in self.violations[:limit]]
            if len(self.violations) > limit:
                lines.append(f"  ... and {len(self.violations) - limit} more")
        lines += [f"note: {n}" for n in self.notes]
        if self.evidence:
            lines.append("log evidence:")
            lines += [f"  {e}" for e in self.evidence[:limit]]
        return "\n".join(lines)


@dataclass
class Outcome:
    """What happened to one waiter."""

    verdict: str  # resumed, timed_out, rejected (failed: its event could not be stored), failed, lost
    problems: list[str] = field(default_factory=list)  # doubled, wrong, premature, early, stalled
    stall: float | None = None
    window: tuple[dt.datetime, dt.datetime] | None = None


def payload_matches(ident: Identity, payload: Any) -> bool:
    """Each waiter's event must be about its own condition."""
    if not isinstance(payload, dict):
        return False
    if ident.kind == TABLE:
        loaded = sorted(payload.get("loaded") or [])
        return payload.get("status") == "success" and loaded == list(ident.tables)
    if ident.kind == FLAG:
        return payload.get("status") == "success"
    return payload == {"key": ident.name}


def condition_time(ident: Identity, conditions: dict[str, dt.datetime]) -> dt.datetime | None:
    names = ident.tables if ident.kind == TABLE else (ident.name,)
    times = [conditions.get(n) for n in names]
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


Windows = Sequence[tuple[dt.datetime, dt.datetime]]


def downtime(faults: Sequence[FaultRecord]) -> list[tuple[dt.datetime, dt.datetime]]:
    """When PostgreSQL itself was down (pg_restart): nothing can be stored then, by anyone, so a stall is
    measured less the downtime inside it, as it is less the database clock's steps."""
    return [(f.started, f.ended) for f in faults if f.kind == "pg_restart" and f.ended is not None]


def _down_within(start: dt.datetime, end: dt.datetime, windows: Windows) -> float:
    """Seconds of ``windows`` between ``start`` and ``end``."""
    return sum(max(0.0, (min(end, b) - max(start, a)).total_seconds()) for a, b in windows)


def judge(waiter: Waiter, entries: list[dict[str, Any]], condition: dt.datetime | None,
          bound: float, due: dt.datetime | None = None, *, down: Windows = ()) -> Outcome:
    """One waiter's audit trail against its condition and its deadline (``due``, as the harness set it)."""
    deferred = [e["at"] for e in entries if e["op"] == "deferred"]
    writes = [e for e in entries if e["op"] in ("resolved", "rewritten", "deleted")]
    if not writes:
        return Outcome("lost", ["still deferred"])
    first = writes[0]
    outcome = _classify(first)
    if len(writes) > 1 or len(deferred) > 1:
        outcome.problems.append(f"doubled: {len(writes)} writes in transactions "
                                f"{[w['txid'] for w in writes]} at {[w['at'].isoformat() for w in writes]}")
    start = max([t for t in (condition, *deferred[:1]) if t is not None], default=None)
    if waiter.identity.kind == POISON:
        _judge_poison(outcome, first, condition=condition, start=start, bound=bound, down=down)
        return outcome
    if outcome.verdict == "rejected":  # only the poison group's event may be refused
        outcome.verdict = "failed"
    if outcome.verdict in ("lost", "failed"):
        return outcome
    expected = _expected(condition, due, bound)
    if outcome.verdict == "timed_out":
        _judge_timeout(outcome, first, due, expected, bound)
    else:
        _judge_event(outcome, waiter, first, condition=condition, start=start, expected=expected, bound=bound,
                     down=down)
    return outcome


def _classify(entry: dict[str, Any]) -> Outcome:
    kwargs = _as_dict(entry["next_kwargs"])
    if entry["op"] == "deleted":
        return Outcome("lost", ["task instance deleted while deferred (trigger row deleted?)"])
    if entry["new_state"] != "scheduled":
        return Outcome("failed", [f"left deferred for state {entry['new_state']!r}"])
    if entry["next_method"] == "__fail__":
        if kwargs.get("error") == "Trigger timeout":
            return Outcome("timed_out")
        cause = "".join(kwargs.get("traceback") or [])
        verdict = "rejected" if REJECTED_MARK in cause else "failed"
        return Outcome(verdict, [f"failed: {kwargs.get('error')!r} {cause[-300:]!r}"])
    return Outcome("resumed")


def _judge_poison(outcome: Outcome, entry: dict[str, Any], *, condition: dt.datetime | None,
                  start: dt.datetime | None, bound: float, down: Windows = ()) -> None:
    """The poison group's tasks must fail with the cause ("could not be stored"), once, in time."""
    if outcome.verdict != "rejected":
        outcome.problems.append(f"wrong: a poison event must fail its task with {REJECTED_MARK!r}; "
                                f"it was {outcome.verdict}")
        if outcome.verdict != "lost":
            outcome.verdict = "failed"
        return
    # the cause is what was expected: not a problem (doubled writes were noted before)
    outcome.problems = [p for p in outcome.problems if not p.startswith("failed:")]
    if condition is None or entry["at"] < condition:
        outcome.problems.append(f"premature: failed at {entry['at'].isoformat()} before its event existed")
        return
    assert start is not None
    stall = (entry["at"] - start).total_seconds() - _down_within(start, entry["at"], down)
    outcome.stall, outcome.window = stall, (start, entry["at"])
    if stall > bound:
        outcome.problems.append(f"stalled: failed {stall:.1f}s after its event came (bound {bound:.0f}s)")


def _expected(condition: dt.datetime | None, due: dt.datetime | None, bound: float) -> str:
    """'event', 'timeout' or 'either' (condition and deadline too close for any triggerer to call)."""
    if due is None:
        return "event"
    if condition is None:
        return "timeout"
    gap = (condition - due).total_seconds()
    if abs(gap) <= bound:
        return "either"
    return "timeout" if gap > 0 else "event"


def _judge_timeout(outcome: Outcome, entry: dict[str, Any], due: dt.datetime | None, expected: str,
                   bound: float) -> None:
    if due is None:
        outcome.problems.append("wrong: timed out without a trigger_timeout")
        return
    late = (entry["at"] - due).total_seconds()
    if late < 0:
        outcome.problems.append(f"early: timed out {-late:.2f}s before its deadline")
    if expected == "event":
        outcome.problems.append("wrong: timed out although its condition held well before the deadline")
    outcome.stall, outcome.window = max(late, 0.0), (due, entry["at"])
    if late > bound:
        outcome.problems.append(f"stalled: timed out {late:.1f}s after due (bound {bound:.0f}s)")


def _judge_event(outcome: Outcome, waiter: Waiter, entry: dict[str, Any], *, condition: dt.datetime | None,
                 start: dt.datetime | None, expected: str, bound: float, down: Windows = ()) -> None:
    payload = _as_dict(entry["next_kwargs"]).get("event")
    if not payload_matches(waiter.identity, payload):
        outcome.problems.append(f"wrong: event {payload!r} is not about {waiter.identity.key}")
    if condition is None or entry["at"] < condition:
        outcome.problems.append(f"premature: resumed at {entry['at'].isoformat()} before its condition "
                                f"held ({condition.isoformat() if condition else 'never'})")
        return
    if expected == "timeout":
        outcome.problems.append("wrong: resumed although its deadline passed well before its condition")
    assert start is not None
    stall = (entry["at"] - start).total_seconds() - _down_within(start, entry["at"], down)
    outcome.stall, outcome.window = stall, (start, entry["at"])
    if stall > bound:
        outcome.problems.append(f"stalled: resumed {stall:.1f}s after its condition held "
                                f"(bound {bound:.0f}s)")


@dataclass
class AssetOutcome:
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    failing_rows: list[int] = field(default_factory=list)
    failing_assets: set[str] = field(default_factory=set)
    events: int = 0
    success_rows: int = 0
    refired: list[str] = field(default_factory=list)  # events whose first holders were struck: how late


def judge_assets(observed: Observed, bound: float, down: Windows = (), retake: float = 0.0) -> AssetOutcome:
    """Every SUCCESS row of a watched table -> exactly one event on that table's asset, and nothing else.

    An event fired by an instance that a fault struck before it stored it (its log says it fired, before
    the one event was stored by another instance) must wait for the next owner's takeover: ``retake``
    seconds (a lease and a loop) are allowed for each such instance, beyond ``bound``. Who stored it is
    the session's application name, which the harness sets to the instance process's name."""
    status_events = [e for e in observed.asset_events if e[1].startswith("chaos://status/")]
    result = AssetOutcome(events=len(status_events))
    by_row: dict[int, list[tuple[int, str, dict[str, Any], dt.datetime | None]]] = {}
    for event in status_events:
        row_id = (event[2].get("payload") or {}).get("row_id")
        by_row.setdefault(row_id if isinstance(row_id, int) else -1, []).append(event)
    rows = {r[0]: r for r in observed.asset_rows}
    for row_id, table, status, at in observed.asset_rows:
        events = by_row.get(row_id, [])
        uri = "chaos://status/" + table.split(".", 1)[1]
        if status != "SUCCESS":
            if events:
                result.wrong.append(f"row {row_id} ({table} {status}) made events {[e[0] for e in events]}")
            continue
        result.success_rows += 1
        struck = _struck_holders(observed, row_id, events)
        _judge_row(result, (row_id, table, at), uri, events, bound, down=down, struck=struck, retake=retake)
    for row_id, events in by_row.items():
        if row_id not in rows:
            result.wrong.append(f"events {[e[0] for e in events]} name no status row ({row_id})")
    return result


def _struck_holders(observed: Observed, row_id: int,
                    events: list[tuple[int, str, dict[str, Any], dt.datetime | None]]) -> int:
    """Instance processes that fired the row's event before another one stored it (none known: 0)."""
    if len(events) != 1 or events[0][3] is None:
        return 0
    stored_by, stored_at = observed.stored_by.get(events[0][0]), events[0][3]
    firings = observed.fired_by.get(row_id, {})
    if stored_by not in firings:
        return 0
    return sum(1 for process, at in firings.items() if process != stored_by and at < stored_at)


def _judge_row(result: AssetOutcome, row: tuple[int, str, dt.datetime], uri: str,
               events: list[tuple[int, str, dict[str, Any], dt.datetime | None]], bound: float, *,
               down: Windows = (), struck: int = 0, retake: float = 0.0) -> None:
    row_id, table, at = row
    if not events or len(events) > 1:
        result.failing_rows.append(row_id)
        result.failing_assets.add(uri)
    if not events:
        result.lost.append(f"row {row_id} ({table} SUCCESS at {at.isoformat()}) has no asset event")
        return
    if len(events) > 1:
        result.doubled.append(f"row {row_id} ({table}) has {len(events)} asset events "
                              f"{[e[0] for e in events]}")
    for event_id, event_uri, extra, _at in events:
        payload = extra.get("payload") or {}
        if event_uri != uri or payload.get("table_name") != table:
            result.wrong.append(f"event {event_id} for row {row_id} ({table}) is on {event_uri} with "
                                f"table_name {payload.get('table_name')!r}")
    created = events[0][3]
    if created is not None:
        latency = (created - at).total_seconds() - _down_within(at, created, down)
        result.latencies.append(latency)
        allowed = bound + struck * retake
        if struck and latency > bound:
            result.refired.append(f"row {row_id} ({table}): {latency:.1f}s, fired before it was stored by "
                                  f"{struck} struck instance(s) (bound {allowed:g}s)")
        if latency > allowed:
            result.stalled.append(f"row {row_id} ({table}): its event came {latency:.1f}s later "
                                  f"(bound {allowed:g}s)")


@dataclass
class BridgeOutcome:
    """The dataset bridge's side: the NUL extra's event dead-lettered alone, every other one delivered."""

    violations: list[str] = field(default_factory=list)
    nul_events: int = 0
    nul_row: str = "none"
    delivered: int = 0
    expected: int = 0
    redelivered: int = 0


def judge_bridge(observed: Observed) -> BridgeOutcome:
    """The NUL extra made exactly one asset event, whose outbox row is dead with jsonb's reason and which
    never reached the inbox; every status-row event's row is delivered and reached it."""
    result = BridgeOutcome()
    nul = [e for e in observed.asset_events if e[1] == NUL_ASSET]
    result.nul_events = len(nul)
    if len(nul) != 1:
        kind = "lost" if not nul else "doubled"
        result.violations.append(f"ASSET {kind}: the NUL extra's watcher made {len(nul)} asset events "
                                 f"{[e[0] for e in nul]} (want exactly one)")
    for event_id, *_rest in nul:
        status, error = observed.outbox.get(event_id, ("no outbox row", None))
        result.nul_row = f"{status} ({error})" if error else status
        if status != "dead" or "jsonb" not in (error or ""):
            result.violations.append(f"BRIDGE wrong: the NUL extra's event {event_id} has outbox row "
                                     f"{result.nul_row!r}, want dead-lettered with jsonb's reason")
        if observed.delivered[event_id]:
            result.violations.append(f"BRIDGE wrong: the NUL extra's event {event_id} reached the inbox")
    for event_id, uri, _extra, _at in observed.asset_events:
        if not uri.startswith("chaos://status/"):
            continue
        result.expected += 1
        status, error = observed.outbox.get(event_id, ("no outbox row", None))
        if status == "delivered" and observed.delivered[event_id]:
            result.delivered += 1
            result.redelivered += observed.delivered[event_id] - 1
        else:
            result.violations.append(f"BRIDGE lost: event {event_id} ({uri}) outbox row {status!r} "
                                     f"({error}), delivered {observed.delivered[event_id]} times")
    return result


def on_host_clock(observed: Observed) -> Observed:
    """The observations with the database clock's steps taken out (``fake_clock.continuous``): every
    duration between two of them is then real time."""
    steps = observed.clock_steps
    if not steps:
        return observed

    def host(moment: dt.datetime) -> dt.datetime:
        return continuous(moment, steps)

    audit = {ti: [{**e, "at": host(e["at"])} for e in entries] for ti, entries in observed.audit.items()}
    return dataclasses.replace(
        observed, audit=audit, conditions={k: host(v) for k, v in observed.conditions.items()},
        asset_rows=[(i, t, status, host(at)) for i, t, status, at in observed.asset_rows],
        asset_events=[(i, uri, extra, None if at is None else host(at))
                      for i, uri, extra, at in observed.asset_events])


def check(plan: Plan, raw: Observed, faults: Sequence[FaultRecord], run: dict[str, Any]) -> Report:
    profile = plan.profile
    outcomes: dict[int, Outcome] = {}
    violations: list[str] = []
    trigger_ids: set[int] = set()
    observed = on_host_clock(raw)
    down = downtime(faults)
    for waiter in plan.waiters:
        entries = observed.audit.get(waiter.ti_id, [])
        cond = condition_time(waiter.identity, observed.conditions)
        due = (None if waiter.timeout_at is None else
               continuous(raw.t0 + dt.timedelta(seconds=waiter.timeout_at), raw.clock_steps))
        outcome = judge(waiter, entries, cond, profile.bound(waiter.poll_interval), due, down=down)
        outcomes[waiter.index] = outcome
        if outcome.verdict in ("lost", "failed") or outcome.problems:
            trigger_ids.update(_trigger_ids(entries, observed.final.get(waiter.ti_id)))
            violations.append(_describe(waiter, outcome, cond, observed))
    assets = judge_assets(observed, profile.bound(profile.asset_poll), down,
                          retake=profile.retake)
    for uri in assets.failing_assets:
        trigger_ids.add(observed.watchers.get(uri, -1))
    violations += [f"ASSET {kind}: {text}" for kind, texts in
                   (("lost", assets.lost), ("doubled", assets.doubled), ("wrong", assets.wrong),
                    ("stalled", assets.stalled)) for text in texts]
    bridge = judge_bridge(observed)
    violations += bridge.violations
    violations += [f"INSTANCE exited on its own: {text}" for text in run["unexpected_exits"]]
    figures = _figures(plan, outcomes, assets, faults, run) + _bridge_figures(bridge, run, raw.clock_steps)
    notes_faults = [f"{f.kind} {f.slot} not made as planned: {f.note}" for f in faults if not f.effective]
    notes = list(run["notes"]) + [f"unclean stop: {u}" for u in run["unclean_stops"]]
    if violations:
        notes += observed.diagnostics
    notes += [f"exited during start-up (database unreachable), restarted: {u}"
              for u in run["startup_exits"]]
    notes += notes_faults
    return Report(figures, violations, notes, trigger_ids, set(assets.failing_rows))


def _bridge_figures(bridge: BridgeOutcome, run: dict[str, Any],
                    steps: Sequence[ClockStep]) -> list[tuple[str, str]]:
    return [
        ("NUL extra: asset events / its outbox row", f"{bridge.nul_events} / {bridge.nul_row[:120]}"),
        ("bridge: status events delivered to the inbox / expected (redeliveries)",
         f"{bridge.delivered} / {bridge.expected} ({bridge.redelivered})"),
        ("inbox refusals (bad signature)", str(run.get("inbox_refusals", 0))),
        ("database clock steps (s)", ", ".join(f"+{(s.after - s.before).total_seconds():.1f}" for s in steps)
         or "none"),
    ]


def _trigger_ids(entries: list[dict[str, Any]], final: tuple[str | None, int | None] | None) -> set[int]:
    found = {e["old_trigger_id"] for e in entries if e.get("old_trigger_id") is not None}
    if final and final[1] is not None:
        found.add(final[1])
    return {int(t) for t in found}


def _describe(waiter: Waiter, outcome: Outcome, cond: dt.datetime | None, observed: Observed) -> str:
    problems = "; ".join(outcome.problems)
    where = observed.stuck.get(waiter.ti_id, "")
    timeout = (f" timeout_at=t0+{waiter.timeout_at:.1f}s" if waiter.timeout_at is not None else "")
    return (f"{outcome.verdict.upper()} {waiter.dag_id}[{waiter.map_index}] ti={waiter.ti_id} "
            f"identity={waiter.identity.key} poll={waiter.poll_interval:g}s push={waiter.push}{timeout} "
            f"condition={cond.isoformat() if cond else None}: {problems} {where}".rstrip())


def _stall_by_fault(outcomes: dict[int, Outcome], faults: Sequence[FaultRecord],
                    lease: float) -> dict[str, float]:
    """The longest stall among waits that overlapped each kind of fault ('none': no fault nearby)."""
    worst: dict[str, float] = {}
    for outcome in outcomes.values():
        if outcome.stall is None or outcome.window is None:
            continue
        start, end = outcome.window
        kinds = {f.kind for f in faults
                 if f.started <= end and (f.ended or end) + dt.timedelta(seconds=lease) >= start}
        for kind in kinds or {"none"}:
            worst[kind] = max(worst.get(kind, 0.0), outcome.stall)
    return worst


def _figures(plan: Plan, outcomes: dict[int, Outcome], assets: AssetOutcome, faults: Sequence[FaultRecord],
             run: dict[str, Any]) -> list[tuple[str, str]]:
    p = plan.profile
    verdicts = Counter(o.verdict for o in outcomes.values())
    problems = Counter(text.split(":")[0] for o in outcomes.values() for text in o.problems)
    stalls = sorted(o.stall for o in outcomes.values() if o.stall is not None)
    kinds = Counter(f.kind for f in faults)
    bounds = sorted({p.bound(w.poll_interval) for w in plan.waiters})
    by_fault = _stall_by_fault(outcomes, faults, p.lease_seconds)
    timed = [w for w in plan.waiters if w.timeout_at is not None]
    figures = [
        ("seed", str(p.seed)),
        ("instances", f"{p.instances} (+1 joining), {p.shards} shards, lease {p.lease_seconds:g}s"),
        ("chaos phase / total wall time (s)", f"{run['chaos_seconds']:.0f} / {run['wall_seconds']:.0f}"),
        ("faults", f"{len(faults)}: " + ", ".join(f"{k} {kinds[k]}" for k in FAULT_KINDS)),
        ("faults made as planned", _as_planned(faults)),
        ("waiters / identities", f"{len(plan.waiters)} / {len(plan.identities)} "
                                 f"({1 - len(plan.identities) / len(plan.waiters):.0%} duplicates)"),
        ("waiters by trigger", ", ".join(f"{k} {n}" for k, n in
                                         sorted(Counter(w.identity.kind for w in plan.waiters).items()))
         + f"; push {sum(w.push for w in plan.waiters)}; second wave {sum(w.wave for w in plan.waiters)}"),
        ("waiters with a timeout", str(len(timed))),
        ("resumed", str(verdicts["resumed"])),
        ("timed out", str(verdicts["timed_out"])),
        ("poison waiters failed with the cause (expected) / poison waiters",
         f"{verdicts['rejected']} / {sum(1 for w in plan.waiters if w.identity.kind == POISON)}"),
        ("failed", str(verdicts["failed"])),
        ("lost", str(verdicts["lost"])),
        ("doubled", str(problems["doubled"])),
        ("wrong (wrong event/outcome, premature, early timeout)",
         str(problems["wrong"] + problems["premature"] + problems["early"])),
        ("stalled over bound", str(problems["stalled"])),
        ("max stall / bound (s)", f"{stalls[-1] if stalls else 0:.2f} / "
                                  f"{bounds[0]:g}-{bounds[-1]:g} (lease + poll interval + 3)"),
        ("stall p50 / p99 (s)", f"{_pct(stalls, 0.5):.2f} / {_pct(stalls, 0.99):.2f}"),
        ("max stall by fault kind (s)", ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_fault.items()))),
        ("status rows SUCCESS / asset events", f"{assets.success_rows} / {assets.events}"),
        ("asset events lost / doubled / wrong / stalled",
         f"{len(assets.lost)} / {len(assets.doubled)} / {len(assets.wrong)} / {len(assets.stalled)}"),
        ("asset event latency max (s)", f"{max(assets.latencies, default=0):.2f} "
                                        f"(bound {p.bound(p.asset_poll):g}, plus "
                                        f"{p.retake:g} per holder struck before "
                                        "storing it)"),
        ("asset events over the bound whose holder was struck before storing",
         "; ".join(assets.refired) if assets.refired else "0"),
        ("instances that exited on their own (while up / during start-up)",
         f"{len(run['unexpected_exits'])} / {len(run['startup_exits'])}"),
        ("unclean stops (SIGTERM exit != 0)", str(len(run["unclean_stops"]))),
        ("exit after SIGTERM max (s)", f"{max(run['term_exit_seconds'], default=0):.1f}"),
        ("HTTP polls", str(run["polls"])),
    ]
    return figures


def _as_planned(faults: Sequence[FaultRecord]) -> str:
    """Faults whose effect is confirmed, of those that need it: a freeze caught inside a transaction, a
    DB error that reached the loop right after a renewal."""
    parts = []
    for kind, what in (("freeze", "frozen inside a transaction"), ("db_error", "error reached the loop")):
        made = [f for f in faults if f.kind == kind]
        parts.append(f"{kind}: {sum(f.effective for f in made)}/{len(made)} {what}")
    return ", ".join(parts)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def run_chaos(profile: Profile, log: Log = print, keep_logs: Path | None = None) -> Report:
    """Run one chaos experiment end to end; every process and temp dir is gone when it returns."""
    return ChaosRun(profile, log, keep_logs).run()


__all__ = ["FAULT_KINDS", "Profile", "Report", "check", "judge", "make_plan", "run_chaos"]
