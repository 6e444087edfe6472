"""The supervisor's nudge (docs/design.md, runner: Nudges): ``NUDGE_SIGNAL`` ends the runner's idle tick at
once, a nudge before the runner listens is ignored, and the supervisor nudges a runner once until it asks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import smart_triggerer.runner.trigger_runner as runner_module
from smart_triggerer.runner.trigger_runner import NUDGE_SIGNAL, SmartTriggerRunner, listen_for_nudges
from smart_triggerer.supervisor.runner_comms import RunnerComms


def test_a_nudge_ends_the_runners_idle_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the idle tick an hour long, the tick returns only because of the nudge."""
    monkeypatch.setattr(runner_module, "IDLE_TICK", 3600.0)

    async def tick_nudged() -> None:
        runner = SmartTriggerRunner()
        runner._wake = asyncio.Event()
        assert listen_for_nudges(runner._on_event)
        try:
            tick = asyncio.create_task(runner._tick())
            await asyncio.sleep(0)  # the tick is waiting
            os.kill(os.getpid(), NUDGE_SIGNAL)
            await asyncio.wait_for(tick, 60)
        finally:
            asyncio.get_running_loop().remove_signal_handler(NUDGE_SIGNAL)

    asyncio.run(tick_nudged())


def test_a_nudge_before_the_runner_listens_is_ignored() -> None:
    """The signal's default action is to be ignored: a runner still starting (or of another build) goes on."""
    sleeper = "import time; print('up', flush=True); time.sleep(1)"
    child = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    os.kill(child.pid, NUDGE_SIGNAL)
    assert child.wait(60) == 0  # not killed by the signal: it slept on and ended by itself
    child.stdout.close()


LISTENER = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.{name}}})  # taken with sigtimedwait, not by a handler
print("listening", flush=True)
got = signal.sigtimedwait({{signal.{name}}}, float(sys.argv[1]))
print("nudged" if got is not None else "not nudged", flush=True)
"""


def _listener(window: float) -> subprocess.Popen[str]:
    """A process that says whether ``NUDGE_SIGNAL`` came within ``window`` seconds of saying it listens."""
    child = subprocess.Popen(
        [sys.executable, "-c", LISTENER.format(name=NUDGE_SIGNAL.name), str(window)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "listening\n"
    return child


def _verdict(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert child.wait(60) == 0
    child.stdout.close()
    return line


def test_the_supervisor_nudges_its_runner_once_until_it_asks() -> None:
    first = _listener(60.0)
    supervisor = SimpleNamespace(pid=first.pid, nudged=False, _exit_code=None)
    RunnerComms._nudge_runner(supervisor)  # type: ignore[arg-type]
    assert _verdict(first) == "nudged"
    assert supervisor.nudged  # until the runner's next request clears it (``_handle_request``)
    # not asked since: no second signal (the listener gives its verdict after its whole window)
    second = _listener(2.0)
    supervisor.pid = second.pid
    RunnerComms._nudge_runner(supervisor)  # type: ignore[arg-type]
    assert _verdict(second) == "not nudged"
    # asked since, but the runner exited (reaped: its pid may be another process's now): nothing sent
    third = _listener(2.0)
    exited = SimpleNamespace(pid=third.pid, nudged=False, _exit_code=0)
    RunnerComms._nudge_runner(exited)  # type: ignore[arg-type]
    assert _verdict(third) == "not nudged"
    RunnerComms._nudge_runner(SimpleNamespace(pid=None, nudged=False, _exit_code=None))  # type: ignore[arg-type]


def test_a_runner_pid_of_zero_or_less_signals_no_process_group() -> None:
    """``kill(0, ...)`` signals every process of the caller's group (a negative pid, another group): a
    supervisor without a runner process (pid 0, as the fault tests build one) nudged the other test
    processes of its group, among them a listener of the test above expecting no signal."""
    listener = _listener(2.0)  # started by this process: in its process group
    for pid in (0, -os.getpgid(0)):
        RunnerComms._nudge_runner(SimpleNamespace(pid=pid, nudged=False, _exit_code=None))  # type: ignore[arg-type]
    assert _verdict(listener) == "not nudged"
