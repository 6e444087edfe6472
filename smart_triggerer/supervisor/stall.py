"""A wedged runner: a trigger that makes a blocking call with no timeout stops the runner's whole event
loop, and every wait of the instance with it, while this supervisor would go on renewing their leases.

Past ``runner_stall_seconds`` without a message from the runner (it syncs every half second, even idle),
the instance steps out of the fleet: it forgets every waiter, leaves the membership and releases every
lease in one statement (as a graceful stop does, so peers take the shards at once, also when every
instance is full: a shard without a live owner always gets one), and ``/health`` answers 503 with the
cause. It names the trigger that holds the loop when the runner's spotter saw one (``loop_lag.py``), or
says that the runner process is stopped.

It steps back in once the runner answers again and has ended the coroutines it was running when it
stepped out (cancelled, without on_kill, as in a handover): their waits run on a peer by then. The runner
is not restarted: stopping it would end the blocking call, but a restart is the orchestrator's job
(``/health`` fails; a Kubernetes liveness probe restarts the pod), and a call that returns on its own (a
slow DNS lookup, a lock) costs the instance nothing more than the time it was out.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
from airflow.utils.net import get_hostname
from airflow.utils.session import create_session

from smart_triggerer.db.store import Store
from smart_triggerer.runner.trigger_runner import LAG_BOARD
from smart_triggerer.supervisor.leases import Leases
from smart_triggerer.supervisor.state import Stall

log = structlog.get_logger(logger_name=__name__)

# a runner that answered within this long counts as answering again (it syncs every half second)
ANSWERING_SECONDS = 1.0
# a supervisor that itself did not look for this long (the whole host frozen, a long step) counts the
# runner's silence from when it looks again: the runner's messages meanwhile were not read, not missing
AWAY_SECONDS = 2.0


class RunnerWatch(Leases):
    def _watch_runner(self) -> None:
        """After the runner's messages were read: step out past the threshold, back in once it answers."""
        limit = self.settings.stall_seconds
        now = time.monotonic()
        if now - self.watched_at > max(AWAY_SECONDS, 2 * self.settings.loop_seconds):
            self.silence_from = now
        self.watched_at = now
        silent = now - max(self._last_runner_comms, self.silence_from)
        if self.stall is None:
            if limit and silent > limit and self._exit_code is None:
                self._step_out(silent, limit)
            return
        if not self.stall.left:
            self._db_step("step out", self._leave_fleet)
        elif silent < ANSWERING_SECONDS and not self.stall.stale_runners & self._alive_runners():
            self._db_step("step in", self._rejoin_fleet)

    def _step_out(self, silent: float, limit: float) -> None:
        holder = LAG_BOARD.read_holder()
        self.stall = Stall(time.monotonic() - silent,
                           f"the trigger runner has not answered for {silent:.0f} s "
                           f"(runner_stall_seconds {limit:g}){self._holder_text(holder)}",
                           stale_runners=self._alive_runners())
        log.error("the trigger runner's event loop is blocked; handing every shard over until it answers",
                  silent_seconds=round(silent, 1), runner_stall_seconds=limit, shards=len(self.owned),
                  waiters=len(self.member_info), **self._holder_details(holder))
        self._drop_shards(set(self.owned) | set(self.leaving))
        self.owned, self.to_read = set(), set()
        self._db_step("step out", self._leave_fleet)
        self.publish_snapshot()

    def _leave_fleet(self) -> None:
        assert self.stall is not None
        with create_session() as session:
            store = Store(session)
            store.stop_instance(self.job_id)
            store.notify_membership(self.job_id, self.queues_key)  # peers claim now, not at their lapse
        self.stall.left = True

    def _rejoin_fleet(self) -> None:
        assert self.stall is not None
        with create_session() as session:
            store = Store(session)
            store.register(self.job_id, get_hostname(), self.capacity, self.queues_key,
                           health_url=self.health_url, shards=self.settings.shards,
                           lease_seconds=self.settings.lease_seconds)
            store.notify_membership(self.job_id, self.queues_key)
        log.info("the trigger runner answers again; taking shards again",
                 out_for_seconds=round(time.monotonic() - self.stall.since, 1))
        self.stall = None
        self._lost_the_feed()  # our membership was stopped: read every waiter of what we take, once
        self._renew_now()

    def _holder_details(self, holder: tuple[int, str] | None) -> dict[str, object]:
        """What can be told of the trigger that holds the loop: its id, its task, how many wait on it
        (never its kwargs)."""
        if holder is None:
            return {"holder": "unknown", "runner_process": self._runner_state()}
        trigger_id, name = holder
        group = self.groups.by_runner(trigger_id)
        return {"holder_trigger_id": trigger_id, "holder_task": name,
                "holder_waiters": None if group is None else len(group.members)}

    def _holder_text(self, holder: tuple[int, str] | None) -> str:
        if holder is not None:
            return f"; trigger {holder[0]} ({holder[1]}) holds its event loop"
        state = self._runner_state()
        return f"; the runner process is {state}" if state != "running" else ""

    def _runner_state(self) -> str:
        """The runner process's state from /proc (Linux): a SIGSTOPped runner spots nothing itself."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return "unknown"
        state = stat.rsplit(")", 1)[-1].split()[0]
        return {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in an uninterruptible wait",
                "Z": "a zombie"}.get(state, "running")
