"""Housekeeping: Airflow's clean_unused and the feed's pruning now and then, forgetting what nobody waits
on any more, the partial index of departed waits, the page's samples, and the check that the schema is
not too new for this release. The part owns when each last ran and what it found; it asks the rest of
the instance through ``Instance`` (the conductor answers)."""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

import structlog
from airflow.utils.session import create_session
from sqlalchemy import text

from smart_triggerer.config import Settings
from smart_triggerer.db.store import SchemaTooNew, Store, queries
from smart_triggerer.supervisor.shared import Shared
from smart_triggerer.waker import leave_stop_signals_to_the_main_thread

log = structlog.get_logger(logger_name=__name__)

# Departures reach the change feed when unused trigger rows are deleted. The triggers of tasks we resume,
# fail or time out are deleted in that same transaction (fanout.py); tasks that left otherwise (cleared,
# marked by hand) are found this often through a partial index that holds only them (release_left_waits),
# so that waiting reads no rows in proportion to the waiters. A departed waiter's coroutine may poll a
# few seconds longer, but a resume or timeout never reaches a task that is not deferred any more.
CLEANUP_SECONDS = 5.0

# What neither path sees (a task row deleted with its DAG run, a timeout the scheduler applied first) is
# left to Airflow's own clean_unused and the lingering check, which read every trigger and waiting task
# row: every [smart_triggerer] sweep_seconds (by default this often), and every CLEANUP_SECONDS until the
# partial index is there.
SWEEP_SECONDS = Settings.sweep_seconds

LEFT_INDEX_CHECK_SECONDS = 60.0
LEFT_INDEX_RETRY_SECONDS = 600.0  # after a failed build (each one reads all of task_instance)

PRUNE_SECONDS = 30.0

SCHEMA_CHECK_SECONDS = 5.0  # how soon a running instance stops after a newer release broke the schema for it

WATCHER_FAILURES_SECONDS = 60.0

LINGERING_SECONDS = 60.0  # the lingering check while the partial index is not there

SAMPLE_SECONDS = 60.0  # a point of the page's last-hour chart

FIRST_SAMPLE_SECONDS = 10.0  # after start: once the first loads have grouped the waiters


class Instance(Protocol):
    """What housekeeping asks of the rest of the instance (the conductor answers)."""

    def clean_unused(self) -> None: ...  # Airflow's: deletes trigger rows nothing refers to
    def read_the_feed_again(self) -> None: ...  # the change feed is gone: read every waiter once
    def stop_with(self, code: int) -> None: ...  # a graceful stop, then this exit code
    def forget_held(self, trigger_id: int) -> None: ...  # an event held for a member that left
    def forget_watcher_failures(self, now: float) -> None: ...


class Housekeeping:
    def __init__(self, shared: Shared, instance: Instance) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.instance = instance
        self.last_cleanup = -math.inf
        self.last_sweep = -math.inf  # Airflow's full clean_unused
        # the partial index release_left_waits reads: its state, when last looked at, the thread building it
        self.left_index = "missing"
        self.left_index_checked = -math.inf
        self.left_index_builder: threading.Thread | None = None
        self.left_index_outcome: str | None = None  # of the last build
        self.left_pending: set[int] = set()  # released, trigger row not deleted yet
        self.last_prune = -math.inf
        self.last_lingering = time.monotonic()
        self.last_watcher_check = time.monotonic()
        self.last_sample = time.monotonic() - SAMPLE_SECONDS + FIRST_SAMPLE_SECONDS
        # the waiters and groups of the latest sample, and when it was recorded: the page's "polls saved"
        # card comes from it, next to groups from the heartbeat, so a change is sampled within
        # FIRST_SAMPLE_SECONDS
        self.sampled: tuple[int, int] | None = None
        self.sampled_at = time.monotonic()
        self.last_schema_check = -math.inf

    def _stop_if_schema_too_new(self) -> None:
        """During a rolling upgrade a newer instance may apply a migration that breaks this release (one
        marked ``BREAKS_OLDER``): stop gracefully (leases released, the newer instances take the shards)
        and exit with code 8, rather than run on a schema this code would misread."""
        try:
            with create_session() as session:
                Store(session).refuse_newer_schema()
        except SchemaTooNew as err:
            log.error("stopping: the schema is newer than this release can run on", error=str(err))
            self.instance.stop_with(int(err.exit_code))

    def run(self) -> None:
        """Airflow's clean_unused (its deletions are how waiters leave) and pruning the change feed, each
        every few seconds rather than every loop, and clean_unused by one instance only: neither is
        urgent, and clean_unused scans."""
        now = time.monotonic()
        shared = self.shared
        # one instance per queue set is enough: the one holding shard 0
        if now - self.last_cleanup >= CLEANUP_SECONDS:
            if 0 in shared.owned:
                self.clean_up(now)
            self.release_unwatched()
            self.last_cleanup = now
        if now - self.last_prune >= PRUNE_SECONDS:
            with create_session() as session:
                store = Store(session)
                store.prune_feed(self.settings.lease_seconds)
                present = store.feed_present()
            if not present:
                self.instance.read_the_feed_again()  # the next loop installs it and reads everything
            self.last_prune = now
        if now - self.last_schema_check >= SCHEMA_CHECK_SECONDS:
            self._stop_if_schema_too_new()
            self.last_schema_check = now
        if now - self.last_watcher_check >= WATCHER_FAILURES_SECONDS:
            self.instance.forget_watcher_failures(now)
            self.last_watcher_check = now
        self.look_at_left_index(now)
        # the partial index catches cleared tasks (the lingering check's main case) within CLEANUP_SECONDS
        lingering_every = self.settings.sweep_seconds if self.left_index == "valid" else LINGERING_SECONDS
        if now - self.last_lingering >= lingering_every:
            self.forget_lingering()
            self.last_lingering = now
        counts = (len(shared.member_info), shared.groups.group_count())
        due = now - self.last_sample >= SAMPLE_SECONDS
        if due or (counts != self.sampled and now - self.sampled_at >= FIRST_SAMPLE_SECONDS):
            self._record_sample(counts, now)
        if due:
            # a minute apart, not a minute after the last (which would drift and skip a minute), unless
            # this loop fell behind
            self.last_sample = max(self.last_sample + SAMPLE_SECONDS, now - SAMPLE_SECONDS / 2)

    def clean_up(self, now: float) -> None:
        """Departed waits leave: through the partial index when it is there, else (and once a sweep) by
        Airflow's clean_unused."""
        if self.left_index == "valid" and now - self.last_sweep < self.settings.sweep_seconds:
            with create_session() as session:
                store = Store(session)
                released = store.release_left_waits()
                # trigger rows someone held a moment ago are tried again: the index no longer shows them
                deleted = store.delete_unused_triggers([*released, *self.left_pending])
                # until the sweep, which clears them (one still referred to is not ours to delete)
                self.left_pending = (self.left_pending | set(released)) - deleted
            if released:
                log.info(
                    "waits whose task left deferred released", tasks=len(released), triggers=len(deleted)
                )
            return
        self.instance.clean_unused()  # Airflow's: reads every trigger row and every waiting task's
        self.left_pending.clear()
        self.last_sweep = now

    def release_unwatched(self) -> None:
        """Asset watchers and callbacks this instance runs whose trigger row nothing refers to any more
        (a watcher removed from its DAG, a paused consumer): deleted as Airflow's clean_unused would, so
        that the feed stops their coroutines within CLEANUP_SECONDS, not at the next sweep."""
        watchers = [m for m in self.shared.member_info if not self.shared.is_task(m)]
        if watchers:
            with create_session() as session:
                Store(session).delete_unused_triggers(watchers)

    def look_at_left_index(self, now: float) -> None:
        """Is the partial index there (still: a DBA or an Airflow migration may drop it)? If it is
        missing, or a build failed, build it in a thread of its own: on a large task_instance table that
        takes a while, and this loop must renew its leases."""
        builder = self.left_index_builder
        built = builder is not None and not builder.is_alive()  # a build just ended: look at once
        wait = LEFT_INDEX_RETRY_SECONDS if self.left_index_outcome == "failed" else LEFT_INDEX_CHECK_SECONDS
        if self.left_index_outcome == "refused" or (now - self.left_index_checked < wait and not built):
            return
        self.left_index_checked = now
        with create_session() as session:
            self.left_index = Store(session).left_index_state()
        if built:
            self.left_index_builder = None
        elif self.left_index in ("missing", "invalid") and builder is None:
            self.left_index_builder = threading.Thread(
                target=self._build_left_index, name="left-index", daemon=True
            )
            self.left_index_builder.start()

    def _build_left_index(self) -> None:
        leave_stop_signals_to_the_main_thread()  # a SIGTERM meanwhile interrupts the loop's select at once
        self.left_index_outcome = build_left_index()

    def _record_sample(self, counts: tuple[int, int], now: float) -> None:
        """A point of the page's chart: once a minute, and when the waiters or groups changed since the
        last one (else the page would show that sample's polls saved beside groups formed after it)."""
        with create_session() as session:
            Store(session).record_sample(
                self.shared.job_id,
                *counts,
                self.shared.groups.polls_saved_per_minute(),
                prune=0 in self.shared.owned,
            )
        self.sampled, self.sampled_at = counts, now

    def forget_lingering(self) -> None:
        """Members whose trigger row Airflow keeps although nothing waits on it (a task cleared while
        deferred): their coroutines stop, as the stock triggerer's do once the row is deleted."""
        shared = self.shared
        with create_session() as session:
            lingering = Store(session).not_waited_on(shared.owned)
        for trigger_id in lingering & set(shared.member_info):
            self.instance.forget_held(trigger_id)
            shared.forget_member(trigger_id, user_action=True)


def build_left_index() -> str:
    """Build the partial index smart_triggerer_ti_left (CONCURRENTLY: Airflow's writes go on), one
    instance at a time; a failed build's invalid index is dropped first. Outside any transaction and
    without our lock and statement limits, which are put back afterwards (the connection returns to
    Airflow's pool): a large table takes minutes to read, and the build waits for older transactions.
    Returns ``built``, ``busy`` (another instance builds it), ``refused`` (the role does not own
    task_instance: logged once, never tried again) or ``failed`` (logged, tried again later); meanwhile
    the sweep does the work."""
    from airflow import settings

    queries_ = queries()
    engine = settings.engine
    assert engine is not None, "Airflow's ORM is configured before the supervisor starts"
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if not conn.execute(text(queries_["try_lock_left_index"])).scalar_one():
                return "busy"
            try:
                conn.execute(text("SET lock_timeout = 0; SET statement_timeout = 0"))
                if Store(conn).left_index_state() == "invalid":  # type: ignore[arg-type]
                    conn.execute(text(queries_["drop_left_index"]))
                started = time.monotonic()
                conn.execute(text(queries_["create_left_index"]))
                log.info(
                    "partial index of departed waits built",
                    index="smart_triggerer_ti_left",
                    seconds=round(time.monotonic() - started, 1),
                )
                return "built"
            finally:
                conn.execute(text("RESET lock_timeout; RESET statement_timeout"))
                conn.execute(text(queries_["unlock_left_index"]))
    except Exception as err:
        refused = getattr(getattr(err, "orig", None), "pgcode", None) == "42501"  # insufficient_privilege
        log.warning(
            "could not build the partial index of departed waits; Airflow's clean_unused runs "
            "every 5 s instead" + ("" if refused else ", and the build is tried again later"),
            index="smart_triggerer_ti_left",
            error=str(err).splitlines()[0],
        )
        return "refused" if refused else "failed"
