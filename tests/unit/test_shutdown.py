"""The order of an instance's exit (``SmartTriggererJobRunner._shutdown``): leases released first, the
runner stopped, then the log files still to write, for a budget counted from the stop signal."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from smart_triggerer.supervisor import service
from smart_triggerer.supervisor.service import SmartTriggererJobRunner


class Recorder:
    """Stands in for the supervisor and the health server: records the calls in order."""

    def __init__(self, calls: list[tuple[str, Any]], health_fails: bool = False) -> None:
        self.calls = calls
        self.health_fails = health_fails
        self.pid = 0
        self.log_files = SimpleNamespace(
            pool=SimpleNamespace(exiting=False),
            uploads=SimpleNamespace(finish=lambda budget: calls.append(("uploads", budget))),
            write_at_exit=lambda budget: calls.append(("write", budget)),
        )

    def release_all(self) -> None:
        self.calls.append(("release", None))

    def kill(self, **_kw: Any) -> None:
        self.calls.append(("kill", self.log_files.pool.exiting))

    def stop(self) -> None:
        self.calls.append(("health stop", None))
        if self.health_fails:
            raise TimeoutError("the endpoint's loop did not answer")


@pytest.fixture
def exit_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # the real ones lower this process's priority and stop its collector: not for a test process
    monkeypatch.setattr(service, "yield_cpu", lambda _pid: None)
    monkeypatch.setattr(service, "leave_the_heap", lambda: None)


def shut_down(signalled_ago: float | None, health_fails: bool = False) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    job_runner = object.__new__(SmartTriggererJobRunner)
    if signalled_ago is not None:
        job_runner.signalled_at = time.monotonic() - signalled_ago
    supervisor = Recorder(calls)
    health = Recorder(calls, health_fails)
    job_runner._shutdown(supervisor, health)  # type: ignore[arg-type]
    return calls


@pytest.mark.usefixtures("exit_steps")
def test_the_log_files_get_what_is_left_of_the_budget_after_the_signal() -> None:
    calls = shut_down(signalled_ago=5.0)
    assert [name for name, _ in calls] == ["release", "kill", "health stop", "write", "uploads"]
    assert calls[1] == ("kill", True)  # the runner's last lines are written as they come
    budget = calls[-2][1]
    assert service.EXIT_LOG_SECONDS - 5.0 - 1.0 < budget <= service.EXIT_LOG_SECONDS - 5.0  # type: ignore[attr-defined]  # what service imported


@pytest.mark.usefixtures("exit_steps")
def test_a_late_exit_still_writes_for_a_second_and_one_without_a_signal_gets_the_whole_budget() -> None:
    assert shut_down(signalled_ago=service.EXIT_LOG_SECONDS + 10)[-2:] == [("write", 1.0), ("uploads", 0.5)]  # type: ignore[attr-defined]
    budget = shut_down(signalled_ago=None)[-2][1]  # the runner died: no signal
    assert service.EXIT_LOG_SECONDS - 1.0 < budget <= service.EXIT_LOG_SECONDS  # type: ignore[attr-defined]


@pytest.mark.usefixtures("exit_steps")
def test_a_health_endpoint_that_fails_to_stop_costs_the_log_files_nothing() -> None:
    with capture_logs() as logs:
        calls = shut_down(signalled_ago=0.0, health_fails=True)
    assert [name for name, _ in calls] == ["release", "kill", "health stop", "write", "uploads"]
    assert any(line["event"] == "the health endpoint did not stop cleanly" for line in logs)
