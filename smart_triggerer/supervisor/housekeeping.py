"""Housekeeping and reports: Airflow's clean_unused and the feed's pruning now and then, forgetting
what nobody waits on any more, the page's samples, and the counters /health, /metrics and the page
read."""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog
from airflow.utils.session import create_session
from sqlalchemy import text

from smart_triggerer.config import Settings
from smart_triggerer.db.store import SchemaTooNew, Store, queries
from smart_triggerer.supervisor.state import (
    FIRST_SAMPLE_SECONDS,
    SAMPLE_SECONDS,
    WATCHER_BACKOFF_MAX_SECONDS,
    SupervisorState,
)
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


class Housekeeping(SupervisorState):
    def _stop_if_schema_too_new(self) -> None:
        """During a rolling upgrade a newer instance may apply a migration that breaks this release (one
        marked ``BREAKS_OLDER``): stop gracefully (leases released, the newer instances take the shards)
        and exit with code 8, rather than run on a schema this code would misread."""
        try:
            with create_session() as session:
                Store(session).refuse_newer_schema()
        except SchemaTooNew as err:
            log.error("stopping: the schema is newer than this release can run on", error=str(err))
            self.stop = True
            self.stop_code = int(err.exit_code)

    def _housekeeping(self) -> None:
        """Airflow's clean_unused (its deletions are how waiters leave) and pruning the change feed, each
        every few seconds rather than every loop, and clean_unused by one instance only: neither is
        urgent, and clean_unused scans."""
        now = time.monotonic()
        # one instance per queue set is enough: the one holding shard 0
        if now - self.last_cleanup >= CLEANUP_SECONDS:
            if 0 in self.owned:
                self._clean_up(now)
            self._release_unwatched()
            self.last_cleanup = now
        if now - self.last_prune >= PRUNE_SECONDS:
            with create_session() as session:
                store = Store(session)
                store.prune_feed(self.settings.lease_seconds)
                present = store.feed_present()
            if not present:
                self.load_xmin = self.hash_xmin = None  # the next loop installs it and reads everything
            self.last_prune = now
        if now - self.last_schema_check >= SCHEMA_CHECK_SECONDS:
            self._stop_if_schema_too_new()
            self.last_schema_check = now
        if now - self.last_watcher_check >= WATCHER_FAILURES_SECONDS:
            self._forget_watcher_failures(now)
            self.last_watcher_check = now
        self._look_at_left_index(now)
        # the partial index catches cleared tasks (the lingering check's main case) within CLEANUP_SECONDS
        lingering_every = self.settings.sweep_seconds if self.left_index == "valid" else LINGERING_SECONDS
        if now - self.last_lingering >= lingering_every:
            self._forget_lingering()
            self.last_lingering = now
        counts = (len(self.member_info), self.groups.group_count())
        due = now - self.last_sample >= SAMPLE_SECONDS
        if due or (counts != self.sampled and now - self.sampled_at >= FIRST_SAMPLE_SECONDS):
            self._record_sample(counts, now)
        if due:
            # a minute apart, not a minute after the last (which would drift and skip a minute), unless
            # this loop fell behind
            self.last_sample = max(self.last_sample + SAMPLE_SECONDS, now - SAMPLE_SECONDS / 2)

    def _clean_up(self, now: float) -> None:
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
        self.clean_unused()  # Airflow's: reads every trigger row and every waiting task's
        self.left_pending.clear()
        self.last_sweep = now

    def _release_unwatched(self) -> None:
        """Asset watchers and callbacks this instance runs whose trigger row nothing refers to any more
        (a watcher removed from its DAG, a paused consumer): deleted as Airflow's clean_unused would, so
        that the feed stops their coroutines within CLEANUP_SECONDS, not at the next sweep."""
        watchers = [m for m in self.member_info if not self._is_task(m)]
        if watchers:
            with create_session() as session:
                Store(session).delete_unused_triggers(watchers)

    def _look_at_left_index(self, now: float) -> None:
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
                self.job_id, *counts, self.groups.polls_saved_per_minute(), prune=0 in self.owned
            )
        self.sampled, self.sampled_at = counts, now

    def _forget_watcher_failures(self, now: float) -> None:
        """A watcher group that has run a while since its last failure counts as working again (one that
        rarely fires would otherwise stay 'failing'); groups that left are forgotten."""
        for identity_hash in list(self.watcher_failures):
            group = self.groups.by_hash.get(identity_hash)
            failed_at = self.watcher_failed_at.get(identity_hash, now)
            working = (
                group is not None
                and group.runner_id is not None
                and (now - failed_at > WATCHER_BACKOFF_MAX_SECONDS)
            )
            if group is None or working:
                self.watcher_failures.pop(identity_hash, None)
                self.watcher_failed_at.pop(identity_hash, None)

    def _forget_lingering(self) -> None:
        """Members whose trigger row Airflow keeps although nothing waits on it (a task cleared while
        deferred): their coroutines stop, as the stock triggerer's do once the row is deleted."""
        with create_session() as session:
            lingering = Store(session).not_waited_on(self.owned)
        for trigger_id in lingering & set(self.member_info):
            self.held.pop(trigger_id, None)
            self._forget_member(trigger_id, user_action=True)

    def _counters(self) -> dict[str, Any]:
        return {
            "runner_alive": self.is_alive(),
            "waiters": len(self.member_info),
            "groups": self.groups.group_count(),
            "events_total": self.events_total,
            "resumed_total": self.resumed_total,
            "failures_total": self.failures_total,
            "watchers_failing": sum(1 for h in self.watcher_failures if h in self.groups.by_hash),
            "watcher_restarts_total": self.watcher_restarts_total,
            "task_state_requests_total": self.task_state_requests_total,
            "health_url": self.health_url,
            **self.load_filters.counters(),
        }

    def publish_snapshot(self) -> None:
        """Copy the counters for the HTTP thread (it must never iterate what this loop mutates)."""
        counters = self._counters()
        counters.update(
            shards_owned=len(self.owned),
            job_id=self.job_id,
            capacity=self.capacity,
            lag_recent_ms=round(self.load_filters.lag_recent_ms, 1),
            shards_taken_total=self.shards_moved_in,
            shards_handed_over_total=self.shards_moved_out,
            coroutines=len(self.running_triggers),
            events_pending=len(self.events),
            events_dead_total=self.dead_letters.total,
            runner_stalled=None if self.watch.stall is None else self.watch.stall.cause,
            last_watcher_error=self.last_watcher_error if counters["watchers_failing"] else None,
        )
        self.published = counters

    def snapshot(self) -> dict[str, Any]:
        """What /metrics and /health report (called from the HTTP thread: reads only published values)."""
        now = time.monotonic()
        pending_since = self.pending_since
        return {
            **self.published,
            "lease_age": now - self.last_renewal,
            "events_stuck_seconds": 0.0 if pending_since is None else now - pending_since,
        }


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
