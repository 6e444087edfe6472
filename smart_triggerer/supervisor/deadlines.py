"""Members' own ends: a member's trigger_timeout (members time out one by one, never the shared
coroutine) and rows whose kwargs cannot be read. The part owns the deadlines and the unreadable rows; the
feed hands it both as it reads waiters."""

from __future__ import annotations

import heapq

import structlog
from airflow.utils.session import create_session

from smart_triggerer.supervisor import fanout
from smart_triggerer.supervisor.shared import Shared

log = structlog.get_logger(logger_name=__name__)


class MemberDeadlines:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        # members' trigger_timeout as (database clock in epoch seconds, trigger id), soonest first
        self.deadlines: list[tuple[float, int]] = []
        self.unreadable: dict[int, tuple[int, str]] = {}  # trigger id -> (shard, cause)

    def add(self, trigger_id: int, timeout_in: float) -> None:
        """A member that times out ``timeout_in`` seconds from now, by the database clock."""
        heapq.heappush(self.deadlines, (self.shared.db_now() + timeout_in, trigger_id))

    def add_unreadable(self, trigger_id: int, shard: int, error: str) -> None:
        self.unreadable[trigger_id] = (shard, error)

    def soonest(self) -> dict[int, float]:
        """Each member's soonest deadline (database clock, epoch seconds)."""
        timeouts: dict[int, float] = {}
        for due, trigger_id in self.deadlines:
            timeouts[trigger_id] = min(due, timeouts.get(trigger_id, due))
        return timeouts

    def timeout_members(self) -> None:
        """Time out deferred members one by one (as the scheduler does) when one's trigger_timeout is due,
        by the database clock; a member still waiting after that (its row was locked) is looked at again
        next loop."""
        shared = self.shared
        now = shared.db_now()
        self._drop_stale()
        if not self.deadlines or self.deadlines[0][0] > now:
            return
        with create_session() as session:
            fenced = shared.fence(session)
            timed_out = fanout.timeout(session, sorted(fenced), shared.queue_list) if fenced else []
        if timed_out:
            # the first triggers by id (a shared deadline can time out thousands at once)
            log.info("timed out deferred tasks", tasks=len(timed_out), trigger_ids=sorted(timed_out)[:50])
        for trigger_id in timed_out:
            if trigger_id in shared.member_info:
                shared.forget_member(trigger_id, user_action=True)
        while self.deadlines and self.deadlines[0][0] <= now:
            _due, trigger_id = heapq.heappop(self.deadlines)
            if trigger_id in shared.member_info:
                heapq.heappush(self.deadlines, (now + shared.settings.loop_seconds, trigger_id))

    def _drop_stale(self) -> None:
        """Deadlines of members that left (resumed, handed over) stay in the heap until due or rebuilt:
        drop them from its top, and rebuild it when they outnumber the members (a deferrable sensor's
        default timeout is 7 days: a busy deployment would keep every resumed task's for a week)."""
        members = self.shared.member_info
        while self.deadlines and self.deadlines[0][1] not in members:
            heapq.heappop(self.deadlines)
        if len(self.deadlines) > 2 * len(members) + 1000:
            soonest: dict[int, float] = {}
            for due, trigger_id in self.deadlines:
                if trigger_id in members:
                    soonest[trigger_id] = min(due, soonest.get(trigger_id, due))
            self.deadlines = [(due, trigger_id) for trigger_id, due in soonest.items()]
            heapq.heapify(self.deadlines)

    def fail_unreadable(self) -> None:
        """Tasks whose trigger kwargs could not be read fail at once with the cause, alone."""
        if not self.unreadable:
            return
        with create_session() as session:
            fenced = self.shared.fence(session)
            for trigger_id, (shard, error) in sorted(self.unreadable.items()):
                if shard not in fenced:
                    continue
                log.error("failing the tasks of an unreadable trigger", trigger_id=trigger_id, error=error)
                failed = fanout.fail(session, [trigger_id], [f"smart-triggerer: {error}\n"])
                self.shared.counters.failures += failed
        # failed, or on a shard another instance holds now (it reads the row when it takes the shard)
        self.unreadable = {}
