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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
from airflow.utils.net import get_hostname
from airflow.utils.session import create_session

from smart_triggerer.db.store import Store
from smart_triggerer.runner.trigger_runner import LAG_BOARD
from smart_triggerer.supervisor.shared import Shared

log = structlog.get_logger(logger_name=__name__)

# a runner that answered within this long counts as answering again (it syncs every half second)
ANSWERING_SECONDS = 1.0
# a supervisor that itself did not look for this long (the whole host frozen, a long step) counts the
# runner's silence from when it looks again: the runner's messages meanwhile were not read, not missing
AWAY_SECONDS = 2.0


@dataclass
class Stall:
    """This instance stepped out of the fleet: its runner stopped answering."""

    since: float  # time.monotonic() of the runner's last message
    cause: str
    stale_runners: set[int] = field(default_factory=set)  # coroutines running when the instance stepped out
    left: bool = False  # the membership and leases are released (retried every loop until they are)


class Instance(Protocol):
    """What the watch asks of the rest of the instance (the conductor answers)."""

    health_url: str | None

    def runner_last_message(self) -> float: ...  # time.monotonic() of the runner's last message
    def runner_exited(self) -> bool: ...
    def runner_pid(self) -> int: ...
    def alive_runners(self) -> set[int]: ...  # coroutines the runner runs or has been handed
    def hand_every_shard_over(self) -> None: ...  # forget every waiter; their coroutines cancelled
    def take_shards_again(self) -> None: ...  # read every waiter of what it takes, and renew at once
    def db_step(self, name: str, step: Callable[[], None]) -> bool: ...
    def publish_snapshot(self) -> None: ...


class RunnerWatch:
    """Owns whether the instance is out of the fleet (``stall``) and since when the runner is silent."""

    def __init__(self, shared: Shared, instance: Instance) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.instance = instance
        self.stall: Stall | None = None  # out of the fleet: the runner is wedged
        self.watched_at = -math.inf  # the watch's last look
        self.silence_from = -math.inf  # the watch counts silence from here

    def look(self) -> None:
        """After the runner's messages were read: step out past the threshold, back in once it answers."""
        limit = self.settings.stall_seconds
        now = time.monotonic()
        if now - self.watched_at > max(AWAY_SECONDS, 2 * self.settings.loop_seconds):
            self.silence_from = now
        self.watched_at = now
        silent = now - max(self.instance.runner_last_message(), self.silence_from)
        if self.stall is None:
            if limit and silent > limit and not self.instance.runner_exited():
                self._step_out(silent, limit)
            return
        if not self.stall.left:
            self.instance.db_step("step out", self._leave_fleet)
        elif silent < ANSWERING_SECONDS and not self.stall.stale_runners & self.instance.alive_runners():
            self.instance.db_step("step in", self._rejoin_fleet)

    def _step_out(self, silent: float, limit: float) -> None:
        holder = LAG_BOARD.read_holder()
        self.stall = Stall(
            time.monotonic() - silent,
            f"the trigger runner has not answered for {silent:.0f} s "
            f"(runner_stall_seconds {limit:g}){self._holder_text(holder)}",
            stale_runners=self.instance.alive_runners(),
        )
        log.error(
            "the trigger runner's event loop is blocked; handing every shard over until it answers",
            silent_seconds=round(silent, 1),
            runner_stall_seconds=limit,
            shards=len(self.shared.owned),
            waiters=len(self.shared.member_info),
            **self._holder_details(holder),
        )
        self.instance.hand_every_shard_over()
        self.instance.db_step("step out", self._leave_fleet)
        self.instance.publish_snapshot()

    def _leave_fleet(self) -> None:
        assert self.stall is not None
        shared = self.shared
        with create_session() as session:
            store = Store(session)
            store.stop_instance(shared.job_id)
            store.notify_membership(shared.job_id, shared.queues_key)  # peers claim now, not at their lapse
        self.stall.left = True

    def _rejoin_fleet(self) -> None:
        assert self.stall is not None
        shared = self.shared
        with create_session() as session:
            store = Store(session)
            store.register(
                shared.job_id,
                get_hostname(),
                shared.capacity,
                shared.queues_key,
                health_url=self.instance.health_url,
                shards=self.settings.shards,
                lease_seconds=self.settings.lease_seconds,
            )
            store.notify_membership(shared.job_id, shared.queues_key)
        log.info(
            "the trigger runner answers again; taking shards again",
            out_for_seconds=round(time.monotonic() - self.stall.since, 1),
        )
        self.stall = None
        self.instance.take_shards_again()  # our membership was stopped: read every waiter of what we take

    def _holder_details(self, holder: tuple[int, str] | None) -> dict[str, object]:
        """What can be told of the trigger that holds the loop: its id, its task, how many wait on it
        (never its kwargs)."""
        if holder is None:
            return {"holder": "unknown", "runner_process": self._runner_state()}
        trigger_id, name = holder
        group = self.shared.groups.by_runner(trigger_id)
        return {
            "holder_trigger_id": trigger_id,
            "holder_task": name,
            "holder_waiters": None if group is None else len(group.members),
        }

    def _holder_text(self, holder: tuple[int, str] | None) -> str:
        if holder is not None:
            return f"; trigger {holder[0]} ({holder[1]}) holds its event loop"
        state = self._runner_state()
        return f"; the runner process is {state}" if state != "running" else ""

    def _runner_state(self) -> str:
        """The runner process's state from /proc (Linux): a SIGSTOPped runner spots nothing itself."""
        try:
            stat = Path(f"/proc/{self.instance.runner_pid()}/stat").read_text()
        except OSError:
            return "unknown"
        state = stat.rsplit(")", 1)[-1].split()[0]
        return {
            "T": "stopped (SIGSTOP)",
            "t": "stopped by a debugger",
            "D": "in an uninterruptible wait",
            "Z": "a zombie",
        }.get(state, "running")
