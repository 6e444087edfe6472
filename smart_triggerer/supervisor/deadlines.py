"""Members' own ends: a member's trigger_timeout (members time out one by one, never the shared
coroutine) and rows whose kwargs cannot be read."""

from __future__ import annotations

import heapq

import structlog
from airflow.utils.session import create_session

from smart_triggerer.supervisor import fanout
from smart_triggerer.supervisor.state import SupervisorState

log = structlog.get_logger(logger_name=__name__)


class MemberDeadlines(SupervisorState):
    def _timeout_members(self) -> None:
        """Time out deferred members one by one (as the scheduler does) when one's trigger_timeout is due,
        by the database clock; a member still waiting after that (its row was locked) is looked at again
        next loop."""
        now = self._db_now()
        self._drop_stale_deadlines()
        if not self.deadlines or self.deadlines[0][0] > now:
            return
        with create_session() as session:
            fenced = self._fence(session)
            timed_out = fanout.timeout(session, sorted(fenced), self.queue_list) if fenced else []
        if timed_out:
            # the first triggers by id (a shared deadline can time out thousands at once)
            log.info("timed out deferred tasks", tasks=len(timed_out), trigger_ids=sorted(timed_out)[:50])
        for trigger_id in timed_out:
            if trigger_id in self.member_info:
                self._forget_member(trigger_id, user_action=True)
        while self.deadlines and self.deadlines[0][0] <= now:
            _due, trigger_id = heapq.heappop(self.deadlines)
            if trigger_id in self.member_info:
                heapq.heappush(self.deadlines, (now + self.settings.loop_seconds, trigger_id))

    def _drop_stale_deadlines(self) -> None:
        """Deadlines of members that left (resumed, handed over) stay in the heap until due or rebuilt:
        drop them from its top, and rebuild it when they outnumber the members (a deferrable sensor's
        default timeout is 7 days: a busy deployment would keep every resumed task's for a week)."""
        while self.deadlines and self.deadlines[0][1] not in self.member_info:
            heapq.heappop(self.deadlines)
        if len(self.deadlines) > 2 * len(self.member_info) + 1000:
            soonest: dict[int, float] = {}
            for due, trigger_id in self.deadlines:
                if trigger_id in self.member_info:
                    soonest[trigger_id] = min(due, soonest.get(trigger_id, due))
            self.deadlines = [(due, trigger_id) for trigger_id, due in soonest.items()]
            heapq.heapify(self.deadlines)

    def _fail_unreadable(self) -> None:
        """Tasks whose trigger kwargs could not be read fail at once with the cause, alone."""
        if not self.unreadable:
            return
        with create_session() as session:
            fenced = self._fence(session)
            for trigger_id, (shard, error) in sorted(self.unreadable.items()):
                if shard not in fenced:
                    continue
                log.error("failing the tasks of an unreadable trigger", trigger_id=trigger_id, error=error)
                self.failures_total += fanout.fail(session, [trigger_id], [f"smart-triggerer: {error}\n"])
        # failed, or on a shard another instance holds now (it reads the row when it takes the shard)
        self.unreadable = {}
