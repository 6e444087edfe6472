"""Housekeeping and reports: Airflow's clean_unused and the feed's pruning now and then, forgetting
what nobody waits on any more, the page's samples, and the counters /health, /metrics and the page
read."""

from __future__ import annotations

import time
from typing import Any

import structlog
from airflow.utils.session import create_session

from triggerer.store import SchemaTooNew, Store
from triggerer.supervisor.state import (
    FIRST_SAMPLE_SECONDS,
    SAMPLE_SECONDS,
    WATCHER_BACKOFF_MAX_SECONDS,
    SupervisorState,
)

log = structlog.get_logger(logger_name=__name__)

# Airflow's clean_unused (how departures reach the change feed: it deletes unused trigger rows) and feed
# pruning run this often, not every loop: a departed waiter's coroutine may poll a few seconds longer,
# but a resume or timeout never reaches a task that is not deferred any more
CLEANUP_SECONDS = 5.0

PRUNE_SECONDS = 30.0

SCHEMA_CHECK_SECONDS = 5.0  # how soon a running instance stops after a newer release broke the schema for it

LINGERING_SECONDS = 60.0


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
        # one instance per queue set is enough (Airflow's clean_unused scans every trigger and task row):
        # the one holding shard 0
        if now - self.last_cleanup >= CLEANUP_SECONDS and 0 in self.owned:
            self.clean_unused()
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
        if now - self.last_lingering >= LINGERING_SECONDS:
            self._forget_watcher_failures(now)
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

    def _record_sample(self, counts: tuple[int, int], now: float) -> None:
        """A point of the page's chart: once a minute, and when the waiters or groups changed since the
        last one (else the page would show that sample's polls saved beside groups formed after it)."""
        with create_session() as session:
            Store(session).record_sample(self.job_id, *counts, self.groups.polls_saved_per_minute(),
                                         prune=0 in self.owned)
        self.sampled, self.sampled_at = counts, now

    def _forget_watcher_failures(self, now: float) -> None:
        """A watcher group that has run a while since its last failure counts as working again (one that
        rarely fires would otherwise stay 'failing'); groups that left are forgotten."""
        for identity_hash in list(self.watcher_failures):
            group = self.groups.by_hash.get(identity_hash)
            failed_at = self.watcher_failed_at.get(identity_hash, now)
            working = group is not None and group.runner_id is not None and (
                now - failed_at > WATCHER_BACKOFF_MAX_SECONDS)
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
            "health_url": self.health_url,
        }

    def publish_snapshot(self) -> None:
        """Copy the counters for the HTTP thread (it must never iterate what this loop mutates)."""
        counters = self._counters()
        counters.update(shards_owned=len(self.owned), job_id=self.job_id,
                        coroutines=len(self.running_triggers), events_pending=len(self.events),
                        events_dead_total=self.dead_letters.total,
                        last_watcher_error=self.last_watcher_error if counters["watchers_failing"] else None)
        self.published = counters

    def snapshot(self) -> dict[str, Any]:
        """What /metrics and /health report (called from the HTTP thread: reads only published values)."""
        now = time.monotonic()
        pending_since = self.pending_since
        return {**self.published, "lease_age": now - self.last_renewal,
                "events_stuck_seconds": 0.0 if pending_since is None else now - pending_since}
