"""The run: start everything, drive the workload and the faults, collect what the databases say."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg2

from devkit.devstack import AirflowConfig, AirflowStack, migrate
from devkit.pgserver import EmbeddedPostgres, create_database
from devkit.system import ensure_libfaketime
from tests.helpers.chaos.checker import Observed, Report, as_dict, check
from tests.helpers.chaos.cluster import Cluster, FaultRecord, wall_clock
from tests.helpers.chaos.constants import (
    ASSET_CHANNEL,
    ASSET_DAG,
    BRIDGE_SOURCE,
    CLASSPATHS,
    CONSUME,
    FLAG,
    NUL_ASSET,
    NUL_KEY,
    NUL_NOTE,
    POISON,
    POISON_MEMBERS,
    ROOT,
    SINK,
    SINK_SECRET_ENV,
    STATUS_TABLE,
    Log,
    team_of,
)
from tests.helpers.chaos.databases import ASSET_DAG_FILE, AUDIT_DDL, Warehouse, db_now, execute
from tests.helpers.chaos.plan import STALE_AFTER, FaultPlan, Identity, Profile, Waiter, make_plan
from tests.helpers.chaos.source import KeySource
from tests.helpers.fake_clock import ClockStep, FakeClockPostgres
from tests.helpers.tcp_proxy import Proxies

# from seeding the first wave to the chaos start: the instances start and claim it meanwhile (4 s when
# the machine is otherwise idle, more beside other tests)
T0_LEAD = 10.0


@dataclass(order=True)
class Action:
    at: float
    seq: int
    label: str = field(compare=False)
    run: Callable[[], None] = field(compare=False)


class ChaosRun:
    """Sets everything up, runs the timeline of flips, rows and faults, waits for quiescence, checks."""

    def __init__(self, profile: Profile, log: Log = print, keep_logs: Path | None = None) -> None:
        self.profile = profile
        self.plan = make_plan(profile)
        self.log = log
        self.keep_logs = keep_logs
        self.faults: list[FaultRecord] = []
        self.notes: list[str] = []
        self.t0_db = wall_clock()
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

    def _run_on(
        self, server: EmbeddedPostgres, source: KeySource, root: Path, resources: contextlib.ExitStack
    ) -> Report:
        self.source = source
        airflow_dsn, warehouse_dsn = self._databases(server, root)
        self.airflow_dsn = airflow_dsn
        self.warehouse = Warehouse(warehouse_dsn)
        self.warehouse.create([i.name for i in self.plan.identities if i.kind == FLAG])
        routes = self._routes(root)
        stack = AirflowStack(self._config(root, airflow_dsn, warehouse_dsn, routes))
        stack.config.dags_folder.mkdir(parents=True, exist_ok=True)
        self.stack = stack
        cluster = Cluster(
            stack,
            server,
            self.log,
            self.proxies,
            lease_seconds=self.profile.lease_seconds,
            uploads=root / "uploads",
        )
        self.cluster = cluster
        resources.callback(self._stop_everything)
        self._sync_assets()
        self._bridge(routes)
        self._seed_wave(0)
        self._set_timeouts()
        for slot in self.profile.slots:
            cluster.start(slot)
        self._wait_loaded()
        self._chaos(self._wait_for_t0())
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
        migrate(
            AirflowConfig(
                home=root / "migrate",
                database_dsn=airflow_dsn,
                dags_folder=root / "dags",
                fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
            )
        )
        execute(airflow_dsn, AUDIT_DDL)
        if self.profile.teams:
            execute(
                airflow_dsn, "INSERT INTO team (name) SELECT unnest(%s::text[])", (list(self.profile.teams),)
            )
        return airflow_dsn, create_database(server.dsn, "chaos_warehouse")

    def _routes(self, root: Path) -> Path:
        """The bridge's routes: every chaos asset to the inbox stub."""
        assets = [f"chaos://status/a{k}" for k in range(self.profile.assets)] + [NUL_ASSET]
        path = root / "routes.json"
        path.write_text(
            json.dumps(
                {
                    "source": BRIDGE_SOURCE,
                    "targets": {
                        SINK: {
                            "url": f"{self.source.url}/inbox",
                            "secret_env": SINK_SECRET_ENV,
                            "assets": assets,
                        }
                    },
                }
            )
        )
        return path

    def _bridge(self, routes: Path) -> None:
        """``dataset-bridge init --routes`` (before any event, as docs/guides/dataset-bridge.md says), then
        the relay."""
        import subprocess
        import sys

        command = [str(Path(sys.executable).with_name("dataset-bridge")), "init", "--routes", str(routes)]
        result = subprocess.run(
            command, env=self.stack.config.env(), capture_output=True, text=True, timeout=300, check=False
        )
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
            # the lag fault's starved runner lags about 1.2 s: over this, it sheds shards (placement moves
            # by load under the other faults); a loaded host's passing lags stay under it
            "AIRFLOW__SMART_TRIGGERER__MAX_LOOP_LAG_MS": "800",
            # the wedge fault's stopped runner: its instance hands every shard over past this
            "AIRFLOW__SMART_TRIGGERER__RUNNER_STALL_SECONDS": str(self.profile.runner_stall_seconds),
            # a two-team fleet: every instance filters by team, those of no team serve rows of no team
            "AIRFLOW__CORE__MULTI_TEAM": str(bool(self.profile.teams)),
        }
        return AirflowConfig(
            home=home,
            database_dsn=airflow_dsn,
            dags_folder=root / "dags",
            fernet_key=os.environ["AIRFLOW__CORE__FERNET_KEY"],
            extra=extra,
        )

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
        path.write_text(
            textwrap.dedent(
                ASSET_DAG_FILE.format(
                    status=STATUS_TABLE,
                    poll=p.asset_poll,
                    channel=ASSET_CHANNEL,
                    dag_id=ASSET_DAG,
                    count=p.assets,
                    nul_uri=NUL_ASSET,
                    source_url=self.source.url,
                    nul_key=NUL_KEY,
                )
            )
        )
        use_airflow_db(self.airflow_dsn)
        _sync_dag(path, self.stack.config.dags_folder)
        watchers = execute(
            self.airflow_dsn,
            "SELECT count(*) FROM asset_watcher w JOIN asset a "
            "ON a.id = w.asset_id WHERE a.uri LIKE 'chaos://%'",
            fetch=True,
        )
        if watchers[0][0] != p.assets + 1:
            raise RuntimeError(f"expected {p.assets + 1} asset watchers, Airflow created {watchers[0][0]}")

    def _seed_wave(self, wave: int) -> None:
        from tests.helpers.seeding import seed_deferred

        for kind, classpath in CLASSPATHS.items():
            for team in (None, *self.profile.teams):
                members = [
                    w
                    for w in self.plan.waiters
                    if w.wave == wave and w.identity.kind == kind and w.identity.team == team
                ]
                if not members:
                    continue
                seeded = seed_deferred(
                    self.airflow_dsn,
                    self.stack.config.dags_folder,
                    count=len(members),
                    classpath=classpath,
                    kwargs_for=partial(_kwargs_of, members, self.source.url),
                    dag_id=f"chaos_w{wave}_{kind}" + (f"_{team}" if team else ""),
                )
                if team is not None:  # as Airflow sets it from the DAG's bundle; before any instance reads
                    execute(
                        self.airflow_dsn,
                        "UPDATE trigger SET team_name = %s WHERE id = ANY(%s)",
                        (team, list(seeded.trigger_ids)),
                    )
                for map_index, (waiter, ti_id) in enumerate(zip(members, seeded.ti_ids, strict=True)):
                    waiter.ti_id, waiter.dag_id, waiter.map_index = ti_id, seeded.dag_id, map_index
        self.log(f"seeded wave {wave + 1}: {sum(1 for w in self.plan.waiters if w.wave == wave)} waiters")

    def _wait_loaded(self) -> None:
        """Start the clock once every first-wave trigger row is claimed by an instance (bounded)."""
        from tests.helpers.waiting import wait_for

        def unclaimed() -> int:
            self.cluster.watch()
            return int(
                execute(
                    self.airflow_dsn,
                    "SELECT count(*) FROM trigger t JOIN task_instance ti "
                    "ON ti.trigger_id = t.id WHERE t.triggerer_id IS NULL",
                    fetch=True,
                )[0][0]
            )

        wait_for(unclaimed, lambda n: n == 0, 240, "every first-wave waiter claimed by an instance", 0.5)

    # --- the timeline ---

    def _chaos(self, late: float) -> None:
        actions = self._actions()
        self.log(f"chaos phase: {self.profile.seconds:.0f}s, {len(actions)} actions")
        start = self.chaos_start = time.monotonic() - late
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
        """Deadlines are part of the deferral, as Airflow writes them: set with the seeding, before any
        instance reads the waiters, relative to a chaos start ``T0_LEAD`` seconds ahead (the instances start
        and claim the first wave meanwhile). Set later, an instance that had already read its members would
        learn of them only by reading its shards again (Airflow never changes a deferred task's
        trigger_timeout; its scheduler's own timeout check covers such a change in a deployment)."""
        self.t0_db = db_now(self.airflow_dsn) + dt.timedelta(seconds=T0_LEAD)
        timed = [w for w in self.plan.waiters if w.timeout_at is not None]
        if timed:
            execute(
                self.airflow_dsn,
                "UPDATE task_instance ti SET trigger_timeout = %s + make_interval(secs => v.offs) "
                "FROM unnest(%s::uuid[], %s::float8[]) AS v(id, offs) WHERE ti.id = v.id",
                (self.t0_db, [w.ti_id for w in timed], [w.timeout_at for w in timed]),
            )

    def _wait_for_t0(self) -> float:
        """Wait for the planned t0 (database clock, not stepped yet), watching the instances meanwhile.
        Returns how late the first wave's claims made it: the timeline then starts that far in, so flips
        and faults keep their planned distance to the deadlines (the overdue ones run at once)."""
        while (late := (db_now(self.airflow_dsn) - self.t0_db).total_seconds()) < 0:
            self.cluster.watch()
            time.sleep(min(0.2, -late))
        if late > 1.0:
            self.notes.append(
                f"the first wave was claimed {late:.1f}s after the planned chaos start "
                f"(T0_LEAD {T0_LEAD:g}s): the timeline's first {late:.1f}s ran at once"
            )
        return late

    def _actions(self) -> list[Action]:
        seq = iter(range(1_000_000))
        flip = self.warehouse.flip
        # the poison group's condition is its fault, the consume-once waits' messages theirs
        actions = [
            Action(i.flip_at, next(seq), f"flip {i.name}", partial(flip, i, self.source))
            for i in self.plan.identities
            if i.kind not in (POISON, CONSUME)
        ]
        actions += [
            Action(at, next(seq), f"row {t} {s}", partial(self.warehouse.status_row, t, s))
            for at, t, s in self.plan.rows
        ]
        actions.append(Action(self.plan.wave_at, next(seq), "wave 2", partial(self._seed_wave, 1)))
        for fault in self.plan.faults:
            record = FaultRecord(fault.kind, fault.slot, wall_clock())
            actions.append(
                Action(
                    fault.at,
                    next(seq),
                    f"{fault.kind} {fault.slot}",
                    partial(self._fault_start, fault, record),
                )
            )
            actions.append(
                Action(
                    fault.at + fault.hold,
                    next(seq),
                    f"end {fault.kind} {fault.slot}",
                    partial(self._fault_end, fault, record),
                )
            )
        return actions

    def _fault_start(self, fault: FaultPlan, record: FaultRecord) -> None:
        record.started = wall_clock()
        self.faults.append(record)
        cluster = self.cluster
        simple: dict[str, Callable[[str], object]] = {
            "sigkill": cluster.kill,
            "sigstop": cluster.pause,
            "sigterm": cluster.terminate,
            "leave": cluster.terminate,
            "join": cluster.start,
            "partition": self.proxies.partition,
            "lag": cluster.throttle,
        }
        if fault.kind in simple:
            simple[fault.kind](fault.slot)
        elif fault.kind == "pg_restart":
            cluster.server.restart(down_seconds=fault.hold)
            record.ended = wall_clock()  # accepting connections again: the end of its downtime
        elif fault.kind == "wedge":
            record.note = cluster.wedge(fault.slot)
        elif fault.kind == "log_hang":
            try:
                record.note = cluster.hang_logs(fault.slot)
            except psycopg2.Error as err:  # its leases out of sight: the store hangs all the same
                record.effective, record.note = False, f"leases not read at the start: {err}"[:300]
        elif fault.kind == "consume":
            record.note = self._consume(fault)
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

    def _consume(self, fault: FaultPlan) -> str:
        """Queue the messages of this fault's consume-once waits, then SIGTERM one instance as they are
        taken (0.7 of a poll later): what its handover took must be stored, what it had not yet taken is
        taken by the next owner. First, a lease and a loop since the last fault that leaves stale
        coroutines behind really ended (the plan spaces them so; a late fault, a long freeze catch, can
        make the timeline run late)."""
        ended = [f.ended or f.started for f in self.faults if f.kind in STALE_AFTER]
        if ended:
            ready_at = max(ended) + dt.timedelta(seconds=self.profile.retake + 2.0)
            while wall_clock() < ready_at:
                self.cluster.watch()
                time.sleep(0.1)
        queued = self._queued_by(fault)
        for ident in queued:
            self.warehouse.flip(ident, self.source)
        time.sleep(0.7 * self.profile.consume_poll)
        self.cluster.terminate(fault.slot)
        return f"{len(queued)} messages queued, then SIGTERM"

    def _queued_by(self, fault: FaultPlan) -> list[Identity]:
        return [i for i in self.plan.identities if i.kind == CONSUME and i.flip_at == fault.at]

    def _consumed(self, fault: FaultPlan) -> tuple[bool, str]:
        """Who took the consume fault's messages: made as planned when the stopped instance took some."""
        takes = self.warehouse.takes()[0]
        takers = Counter(
            taker for ident in self._queued_by(fault) for _message, taker in takes.get(ident.name, [])
        )
        stopped = self.cluster.process_name(fault.slot)  # not restarted yet
        said = ", ".join(f"{n} by {taker}" for taker, n in sorted(takers.items()))
        return takers[stopped] > 0, f"taken: {said or 'none yet'} ({stopped} was stopped)"

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
        record.ended = wall_clock()

    def _fault_end(self, fault: FaultPlan, record: FaultRecord) -> None:
        if fault.kind == "consume":
            record.effective, record.note = self._consumed(fault)
        if fault.kind in ("sigkill", "sigterm", "consume"):
            self.cluster.start(fault.slot)
        elif fault.kind == "log_hang":
            record.effective, record.note = self.cluster.unhang_logs(fault.slot)
        elif fault.kind == "sigstop":
            self.cluster.unpause(fault.slot)
        elif fault.kind == "lag":
            record.effective, record.note = self.cluster.unthrottle(fault.slot)
        elif fault.kind == "wedge":
            record.effective, record.note = self.cluster.unwedge(fault.slot)
        elif fault.kind == "freeze":
            # never woken: killed and replaced in its slot, as an orchestrator would
            self.cluster.kill(fault.slot)
            self.cluster.start(fault.slot)
        elif fault.kind == "partition":
            self.proxies.heal(fault.slot)
        if record.ended is None:
            record.ended = wall_clock()

    def _progress(self, elapsed: float) -> None:
        with contextlib.suppress(psycopg2.Error):
            found = execute(
                self.airflow_dsn,
                "SELECT count(*) FILTER (WHERE op = 'resolved'), "
                "(SELECT count(*) FROM chaos.asset_event_audit) "
                "FROM chaos.ti_audit",
                fetch=True,
                retry_for=0,
            )[0]
            self.log(
                f"  {elapsed:6.1f}s faults {len(self.faults)}, resolved {found[0]}/"
                f"{len(self.plan.waiters)}, asset events {found[1]}, polls {self.source.polls}"
            )

    # --- the end ---

    def _finish(self) -> None:
        """All conditions hold by now; wait (bounded) until nothing waits and every row has its event."""
        from tests.helpers.waiting import wait_for

        self.cluster.release()
        success_rows = sum(1 for _at, _t, status in self.plan.rows if status == "SUCCESS")
        worst = self.profile.bound(max(*self.profile.polls, self.profile.push_poll))

        def pending() -> tuple[int, int, int, int]:
            self.cluster.watch()
            found = execute(
                self.airflow_dsn,
                "SELECT (SELECT count(*) FROM task_instance WHERE state = "
                "'deferred'), (SELECT count(*) FROM chaos.asset_event_audit), "
                "(SELECT count(*) FROM dataset_bridge.outbox WHERE status = "
                "'pending'), (SELECT count(*) FROM dataset_bridge.outbox "
                "WHERE status = 'dead')",
                fetch=True,
            )[0]
            return int(found[0]), int(found[1]), int(found[2]), int(found[3])

        try:
            # the NUL extra's event too, and its dead letter (the relay sweeps every 10 s)
            wait_for(
                pending,
                lambda v: v[0] == 0 and v[1] >= success_rows + 1 and v[2] == 0 and v[3] >= 1,
                worst + 60,
                "quiescence (no deferred waiter, one event per SUCCESS row and the NUL "
                "extra's, nothing left to relay, the NUL extra's event dead-lettered)",
                0.5,
            )
        except AssertionError as err:
            self.notes.append(str(err))
            self.log(str(err))
        # Not for correctness: gives a fenced-out writer the chance to show a late second write.
        time.sleep(self.profile.lease_seconds)

    def _observe(self, diagnostics: list[str]) -> Observed:
        dsn = self.airflow_dsn
        audit: dict[str, list[dict[str, Any]]] = {}
        columns = (
            "ti_id",
            "at",
            "op",
            "new_state",
            "old_trigger_id",
            "next_method",
            "next_kwargs",
            "trigger_timeout",
            "txid",
            "writer",
            "shard",
        )
        for row in execute(dsn, f"SELECT {', '.join(columns)} FROM chaos.ti_audit ORDER BY seq", fetch=True):
            entry = dict(zip(columns, row, strict=True))
            audit.setdefault(str(entry["ti_id"]), []).append(entry)
        final = {
            str(r[0]): (r[1], r[2])
            for r in execute(
                dsn,
                "SELECT id, state, trigger_id FROM task_instance WHERE dag_id LIKE 'chaos_w%'",
                fetch=True,
            )
        }
        found = execute(
            dsn,
            "SELECT e.id, a.uri, e.extra, au.at, au.app "
            "FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "LEFT JOIN chaos.asset_event_audit au ON au.event_id = e.id "
            "WHERE a.uri LIKE 'chaos://%' ORDER BY e.id",
            fetch=True,
        )
        events = [(int(r[0]), r[1], as_dict(r[2]), r[3]) for r in found]
        stored_by = {int(r[0]): r[4] for r in found if r[4]}
        takes, left = self.warehouse.takes()
        outbox = {
            int(r[0]): (str(r[1]), r[2])
            for r in execute(
                dsn,
                "SELECT asset_event_id, status, last_error FROM dataset_bridge.outbox WHERE target = %s",
                (SINK,),
                fetch=True,
            )
        }
        return Observed(
            audit,
            final,
            self._stuck(final),
            self.warehouse.condition_times(),
            self.warehouse.asset_rows(),
            events,
            self.t0_db,
            diagnostics,
            clock_steps=list(self.clock_steps),
            outbox=outbox,
            delivered=Counter(self.source.received),
            fired_by=fired_by(self.stack.log_dir),
            stored_by=stored_by,
            took=took_shards(self.stack.log_dir),
            takes=takes,
            queue_left=left,
        )

    def _diagnostics(self) -> tuple[list[str], dict[str, int]]:
        """Taken before the instances stop: where each asset watcher runs, instances, status watermarks."""
        watchers = execute(
            self.airflow_dsn,
            "SELECT a.uri, w.trigger_id, t.triggerer_id, i.shard, l.owner_job_id, l.expires_at > now() "
            "FROM asset_watcher w JOIN asset a ON a.id = w.asset_id JOIN trigger t ON t.id = w.trigger_id "
            "LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id "
            "LEFT JOIN smart_triggerer.shard_lease l ON l.shard = i.shard ORDER BY a.uri",
            fetch=True,
        )
        found = [
            f"watcher {r[0]}: trigger {r[1]} triggerer_id={r[2]} shard={r[3]} lease owner={r[4]} live={r[5]}"
            for r in watchers
        ]
        instances = execute(
            self.airflow_dsn,
            "SELECT job_id, now() - heartbeat_at, waiters, groups "
            "FROM smart_triggerer.instance WHERE stopped_at IS NULL AND "
            "heartbeat_at > now() - interval '30 seconds' ORDER BY job_id",
            fetch=True,
        )
        found += [
            f"live instance job {r[0]}: heartbeat age={r[1]} waiters={r[2]} groups={r[3]}" for r in instances
        ]
        # the NUL extra's event is left out: its extra cannot be cast to jsonb
        orphan_keys = execute(
            self.airflow_dsn,
            "SELECT k.asset_id, k.idempotency_key FROM smart_triggerer.asset_event_key k "
            "JOIN asset a ON a.id = k.asset_id AND a.uri LIKE 'chaos://status/%' WHERE NOT EXISTS "
            "(SELECT 1 FROM asset_event e WHERE e.asset_id = k.asset_id "
            # CASE: the planner may read the NUL extra's row too, whatever the join says
            "AND CASE WHEN position('\\u0000' in e.extra::text) > 0 THEN false ELSE "
            "CAST(e.extra AS jsonb) -> 'payload' ->> 'idempotency_key' = k.idempotency_key END)",
            fetch=True,
        )
        found += [f"idempotency key claimed without an asset event: asset {r[0]} {r[1]}" for r in orphan_keys]
        with contextlib.suppress(psycopg2.Error):
            marks = execute(
                self.warehouse.dsn,
                "SELECT table_name, last_id, updated_at FROM "
                "dataset_bridge.status_watermark ORDER BY table_name",
                fetch=True,
            )
            found += [f"status watermark {r[0]}: last_id={r[1]} updated_at={r[2]}" for r in marks]
        return found, {r[0]: int(r[1]) for r in watchers}

    def _stuck(self, final: dict[str, tuple[str | None, int | None]]) -> dict[str, str]:
        """Where the trigger of each still-deferred waiter stands: its shard and the shard's lease."""
        ids = [t for ti, (state, t) in final.items() if state == "deferred" and t is not None]
        if not ids:
            return {}
        rows = execute(
            self.airflow_dsn,
            "SELECT t.id, t.triggerer_id, i.shard, i.error, l.owner_job_id, l.expires_at "
            "FROM trigger t LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id "
            "LEFT JOIN smart_triggerer.shard_lease l ON l.shard = i.shard WHERE t.id = ANY(%s)",
            (ids,),
            fetch=True,
        )
        where = {
            r[0]: f"trigger {r[0]} triggerer_id={r[1]} shard={r[2]} identity_error={r[3]!r} "
            f"lease owner={r[4]} expires={r[5]}"
            for r in rows
        }
        return {
            ti: where.get(t, f"trigger {t}")
            for ti, (state, t) in final.items()
            if state == "deferred" and t is not None
        }

    def _figures_in(self) -> dict[str, Any]:
        return {
            "chaos_seconds": self.chaos_seconds,
            "wall_seconds": time.monotonic() - self.started,
            "unexpected_exits": list(self.cluster.unexpected_exits),
            "startup_exits": list(self.cluster.startup_exits),
            "unclean_stops": list(self.cluster.unclean_stops),
            "notes": list(self.notes),
            "term_exit_seconds": list(self.cluster.term_exit_seconds),
            "polls": self.source.polls,
            "inbox_refusals": self.source.inbox_refusals,
            "lapses": list(self.cluster.lapses),
        }

    def _evidence(self, trigger_ids: set[int], row_ids: set[int], per_component: int = 12) -> list[str]:
        """Log lines that name a failing waiter's trigger or a lost status row, and each component's last
        errors (bounded)."""
        trigger = re.compile(r"\b(?:trigger_id|runner_id|trigger|ID)[=: ]+(\d+)\b")
        row = re.compile(r"'row_id': (\d+)")

        def names(line: str) -> bool:
            return any(int(m) in trigger_ids for m in trigger.findall(line)) or any(
                int(m) in row_ids for m in row.findall(line)
            )

        lines: list[str] = []
        for log_file in sorted(self.stack.log_dir.glob("*.log")):
            text = log_file.read_text(errors="replace").splitlines()
            named = [ln for ln in text if names(ln)]
            errors = [ln for ln in text if "[error" in ln or "[critical" in ln]
            for line in named[:per_component] + errors[-3:]:
                lines.append(f"{log_file.stem}: {line[:400]}")
        return lines


INSTANCE_LOG = re.compile(r"^[a-z]+-\d+(\.\d+)?$")  # smart-3.13, alpha-2: not the relay
FIRED_LINE = re.compile(r"^(\S+Z) .*Trigger fired event.*'row_id': (\d+)")
TOOK_LINE = re.compile(r"^(\S+Z) .*took shards .*shards=\[([\d, ]*)\]")


def _matching_lines(
    log_dir: Path, pattern: re.Pattern[str]
) -> Iterator[tuple[str, dt.datetime, re.Match[str]]]:
    """(instance process, the line's time, the match) of every instance log line ``pattern`` matches; the
    pattern's first group is the line's timestamp."""
    for log_file in sorted(f for f in log_dir.glob("*.log") if INSTANCE_LOG.match(f.stem)):
        for line in log_file.read_text(errors="replace").splitlines():
            found = pattern.search(line)
            if found:
                yield log_file.stem, dt.datetime.fromisoformat(found.group(1).replace("Z", "+00:00")), found


def took_shards(log_dir: Path) -> dict[tuple[str | None, int], list[tuple[dt.datetime, str]]]:
    """When each instance process took each shard of its team's space (their logs' "took shards" lines),
    by (team, shard): each team's shards are leases of their own."""
    took: dict[tuple[str | None, int], list[tuple[dt.datetime, str]]] = {}
    for process, at, found in _matching_lines(log_dir, TOOK_LINE):
        for shard in filter(None, (s.strip() for s in found.group(2).split(","))):
            took.setdefault((team_of(process), int(shard)), []).append((at, process))
    return took


def fired_by(log_dir: Path) -> dict[int, dict[str, dt.datetime]]:
    """Which instance processes fired each status row's event, and when first (their logs' lines)."""
    fired: dict[int, dict[str, dt.datetime]] = {}
    for process, at, found in _matching_lines(log_dir, FIRED_LINE):
        by_process = fired.setdefault(int(found.group(2)), {})
        by_process[process] = min(at, by_process.get(process, at))
    return fired


def _kwargs_of(members: Sequence[Waiter], url: str, index: int) -> dict[str, Any]:
    return members[index].kwargs(url)
