"""The faults: the instances and PostgreSQL of a chaos run, and what is done to them."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg2

from devkit.devstack import AirflowStack, Component
from devkit.pgserver import EmbeddedPostgres, sqlalchemy_url
from tests.helpers.chaos.constants import STARTED_MARK, TEAM_MARK_ENV, Log, team_of
from tests.helpers.tcp_proxy import Proxies
from tests.helpers.throttle import RunnerThrottle


@dataclass
class FaultRecord:
    kind: str
    slot: str
    started: dt.datetime
    ended: dt.datetime | None = None
    note: str = ""  # what the fault did (a frozen backend's state, a step's size, whether an error landed)
    effective: bool = True  # False: the fault could not be made as planned (see note)


def wall_clock() -> dt.datetime:
    """The host clock, which the local PostgreSQL's clock_timestamp() also reads (less its steps)."""
    return dt.datetime.now(dt.UTC)


JOB_ID = re.compile(STARTED_MARK + r".*?\bjob_id=(\d+)")
IN_TRANSACTION = (
    "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
    "AND datname = current_database() AND xact_start IS NOT NULL "
    "AND state IN ('active', 'idle in transaction')"
)
LEASE_EXPIRY = "SELECT max(expires_at) FROM smart_triggerer.shard_lease WHERE owner_job_id = %s"
TERMINATE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s "
    "AND datname = current_database() AND pid <> pg_backend_pid()"
)
DB_UNAVAILABLE = "database unavailable"
SHEDDING_MARK = "over a limit: taking no new shards"  # supervisor/load.py's line when shedding starts
WEDGED_MARK = "event loop is blocked; handing every shard over"  # supervisor/stall.py's step-out line
THROTTLE_STOPPED, THROTTLE_PERIOD = 1.2, 1.5  # a lag of about 1.2 s: over the run's max_loop_lag_ms
# the instance's leases: how many, and the least renewed one's expiry (database clock)
OWNED = (
    "SELECT count(*), min(expires_at), clock_timestamp() FROM smart_triggerer.shard_lease "
    "WHERE owner_job_id = %s"
)
# every instance uploads its ended triggers' logs to a remote store that hangs while the log_hang fault
# holds (tests/helpers/remote_logs.py: an upload blocks until the file "release" exists in its folder)
REMOTE_LOGS = {"AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS": "tests.helpers.remote_logs.LOGGING_CONFIG"}


class Cluster:
    """The smart triggerer instances (by slot), the relay, and the PostgreSQL server under them.

    Each instance reaches the metadata database through its slot's proxy and names its sessions after
    itself (``PGAPPNAME``, which libpq reads: Airflow's psycopg2 connections carry it). Signals go to one
    instance's process group (Component.signal), never by name. A slot that is not deliberately down and
    whose process exited is an unexpected exit: recorded and restarted.
    """

    def __init__(
        self,
        stack: AirflowStack,
        server: EmbeddedPostgres,
        log: Log,
        proxies: Proxies,
        *,
        lease_seconds: float,
        uploads: Path,
    ) -> None:
        self.stack, self.server, self.log, self.proxies = stack, server, log, proxies
        self.lease_seconds = lease_seconds
        self.uploads = uploads  # one folder per instance process: its remote log store
        self.hung: dict[str, Hang] = {}  # slot -> what its hanging store's fault saw at the start
        self.lapses: list[str] = []  # instances whose leases lapsed while their log store hung
        self.slots: dict[str, Component] = {}
        self.down: set[str] = set()
        self.paused: set[str] = set()
        self.frozen: set[str] = set()
        self.throttled: dict[str, tuple[RunnerThrottle, int]] = {}  # slot -> its throttle, its log's offset
        self.wedged: dict[str, tuple[psutil.Process, int]] = {}  # slot -> its stopped runner, log offset
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
        name = self.process_name(slot)
        proxy = self.proxies.get(slot)
        through = re.sub(r"@127\.0\.0\.1:\d+/", f"@127.0.0.1:{proxy.port}/", self.dsn)
        store = self.uploads / name
        store.mkdir(parents=True, exist_ok=True)
        (store / "release").touch()
        env = {
            "PGAPPNAME": name,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(through),
            # capacity is a cap: the survivors of a fault must have room for every wait
            "AIRFLOW__TRIGGERER__CAPACITY": "100000",
            **REMOTE_LOGS,
            "HANGING_UPLOADS_DIR": str(store),
        }
        team = team_of(slot)
        if team is not None:
            env[TEAM_MARK_ENV] = team
        component = self.stack.start_smart_triggerer(name, env=env, team_name=team)
        self.slots[slot] = component
        self.down.discard(slot)
        return component

    def process_name(self, slot: str) -> str:
        """The name of the slot's latest process (smart-3.13: its 13th start), its sessions' and log's."""
        number = self.generation[slot]
        return slot if number <= 1 else f"{slot}.{number}"

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
        self.wedged.pop(slot, None)

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
                self.unclean_stops.append(
                    f"{component.name} still running {deadline - since:.0f}s after SIGTERM; killed"
                )
                component.signal(signal.SIGKILL)
                component.process.wait(10)
                continue
            self.term_exit_seconds.append(time.monotonic() - since)
            if code != 0:
                self.unclean_stops.append(f"{component.name} exited with {code} on SIGTERM")

    def throttle(self, slot: str) -> None:
        """Starve the instance's trigger runner (stopped 80% of every 1.5 s): its event loop lags past
        the chaos run's ``max_loop_lag_ms``, and placement hands its shards over while it runs on."""
        from tests.helpers.waiting import wait_for

        component = self.slots[slot]
        # the supervisor's one child, Airflow's trigger runner: a slot restarted a moment ago (after a
        # freeze, a kill) forks it once its start-up is done
        tree = wait_for(component.tree, lambda t: len(t) > 1, 60, f"{component.name}'s trigger runner", 0.1)
        self.throttled[slot] = (
            RunnerThrottle(tree[1], stopped=THROTTLE_STOPPED, period=THROTTLE_PERIOD),
            component.log_path.stat().st_size,
        )
        self.throttled[slot][0].start()

    def unthrottle(self, slot: str) -> tuple[bool, str]:
        """End the throttle; whether the instance shed shards meanwhile (its log says so)."""
        throttle, offset = self.throttled.pop(slot)
        throttle.stop()
        shed = SHEDDING_MARK in _log_since(self.slots[slot], offset)
        return shed, "shed shards while lagging" if shed else "lagged without shedding"

    def wedge(self, slot: str) -> str:
        """Stop the instance's trigger runner alone (SIGSTOP), as a trigger blocking its event loop does:
        its supervisor goes on, and must hand every shard over past ``runner_stall_seconds``."""
        from tests.helpers.waiting import wait_for

        component = self.slots[slot]
        tree = wait_for(component.tree, lambda t: len(t) > 1, 60, f"{component.name}'s trigger runner", 0.1)
        runner = tree[1]
        runner.send_signal(signal.SIGSTOP)
        self.wedged[slot] = (runner, component.log_path.stat().st_size)
        return f"runner pid {runner.pid} stopped"

    def unwedge(self, slot: str) -> tuple[bool, str]:
        """Let the runner go on; whether its instance stepped out meanwhile (its log says so)."""
        runner, offset = self.wedged.pop(slot, (None, 0))
        if runner is None:
            return False, "the instance was gone"
        with contextlib.suppress(psutil.NoSuchProcess):
            runner.send_signal(signal.SIGCONT)
        stepped = WEDGED_MARK in _log_since(self.slots[slot], offset)
        return stepped, "handed every shard over" if stepped else "did not step out"

    def hang_logs(self, slot: str) -> str:
        """The instance's remote log store stops answering: each upload from now on blocks."""
        component = self.slots[slot]
        job = self.job_of(component)
        owned, _least, now = self._owned(job)
        store = self.uploads / component.name
        (store / "release").unlink(missing_ok=True)
        self.hung[slot] = Hang(component.name, store, job, owned, now)
        return f"uploads of {component.name} hang ({owned} shards held)"

    def unhang_logs(self, slot: str) -> tuple[bool, str]:
        """Before the store answers again: the instance must still hold its shards, every lease renewed
        after the hang began plus a lease (a loop stalled by an upload renews nothing, and its shards
        lapse and move); a violation otherwise. Made as planned when an upload hung meanwhile."""
        hang = self.hung.pop(slot)
        hung = [f for f in hang.store.glob("*.started") if not f.with_suffix(".uploaded").exists()]
        try:
            owned, least, _now = self._owned(hang.job)
        finally:
            (hang.store / "release").touch()
        renewed = least is not None and least > hang.since + dt.timedelta(seconds=self.lease_seconds)
        if hang.owned and not (owned and renewed):
            self.lapses.append(
                f"{hang.process} held {hang.owned} shards when its remote log store began to "
                f"hang at {hang.since.isoformat()}; {owned} when it answered again, the "
                f"least renewed lease expiring {least.isoformat() if least else None}"
            )
        said = f"{len(hung)} uploads hung" if hung else "no upload began while it hung"
        return bool(hung) and bool(hang.owned), f"{said}; shards held {hang.owned} -> {owned}"

    def _owned(self, job: int) -> tuple[int, dt.datetime | None, dt.datetime]:
        conn = psycopg2.connect(self.dsn, connect_timeout=5)
        try:
            with conn.cursor() as cur:
                cur.execute(OWNED, (job,))
                count, least, now = cur.fetchone()
                return int(count), least, now
        finally:
            conn.close()

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
                        cur.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (held[0],))
                        last = " ".join(str((cur.fetchone() or ("?",))[0]).split())[:120]
                        return True, (
                            f"backend {held[0]} idle in transaction ({len(states)} sessions) after {last!r}"
                        )
                    component.signal(signal.SIGCONT)
        finally:
            conn.close()
        component.signal(signal.SIGSTOP)
        self.frozen.add(slot)
        return False, f"no session seen inside a transaction in {within:.0f}s: frozen outside one"

    def job_of(self, component: Component, within: float = 60.0) -> int:
        """The instance's job id, from its start-up line (waited for, bounded)."""
        from tests.helpers.waiting import wait_for

        found = wait_for(
            lambda: JOB_ID.search(_log_head(component)),
            bool,
            within,
            f"{component.name} to log its start",
            0.1,
        )
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
        """Wake every paused or throttled instance (a stopped process cannot act on SIGTERM), kill the
        frozen ones (never woken), heal every partition."""
        for slot in list(self.throttled):
            self.unthrottle(slot)
        for slot in list(self.hung):
            self.unhang_logs(slot)
        for slot in list(self.paused):
            self.unpause(slot)
        for slot in list(self.frozen):
            self.kill(slot)
        for slot in list(self.proxies.by_name):
            self.proxies.heal(slot)


@dataclass(frozen=True)
class Hang:
    process: str
    store: Path
    job: int
    owned: int  # shards it held when its store began to hang
    since: dt.datetime  # the database clock then


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
        cur.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE application_name = %s "
            "AND datname = current_database()",
            (application,),
        )
        states = [(int(r[0]), str(r[1])) for r in cur.fetchall()]
        if all(state != "active" for _pid, state in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.005)
