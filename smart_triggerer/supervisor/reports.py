"""What the instance reports: the counters its heartbeat publishes, and the snapshot /health, /metrics
and the page read (copied for the HTTP thread, which must never iterate what the loop mutates). They read
every part's state, so they are the conductor's (a mixin of it), not a part's."""

from __future__ import annotations

import time
from typing import Any

from smart_triggerer.supervisor.state import SupervisorState


class Reports(SupervisorState):
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
            shards_taken_total=self.leases.shards_moved_in,
            shards_handed_over_total=self.leases.shards_moved_out,
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
            "lease_age": now - self.leases.last_renewal,
            "events_stuck_seconds": 0.0 if pending_since is None else now - pending_since,
        }
