"""The runner's log lines per coroutine: Airflow's ``run_trigger`` under ``SmartTriggerRunner``'s logger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import nullcontext
from typing import Any

import pytest
from airflow.triggers.base import BaseTrigger, TriggerEvent
from structlog.testing import capture_logs

from smart_triggerer.runner.trigger_runner import HANDOVER_CANCEL_MSG, SmartTriggerRunner

NAME = "test trigger"
STARTING = f"trigger {NAME} starting"


class _Trigger(BaseTrigger):
    """Fires ``events`` events, then returns; waits forever when ``forever``."""

    def __init__(self, events: int, forever: bool = False) -> None:
        super().__init__()
        self.events, self.forever = events, forever
        self.task_instance = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Trigger", {"events": self.events, "forever": self.forever})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for n in range(self.events):
            yield TriggerEvent({"n": n})
        while self.forever:
            await asyncio.sleep(3600)


def _lines_of(trigger: _Trigger, *, cancel: bool = False) -> list[str]:
    """The events logged while one coroutine runs to its end (or is cancelled as at a handover)."""

    async def run() -> None:
        runner = SmartTriggerRunner()
        task = asyncio.create_task(runner.run_trigger(1, trigger))
        runner.triggers[1] = {"task": task, "is_watcher": False, "name": NAME, "events": 0}
        if cancel:
            while runner.triggers[1]["events"] < trigger.events:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel(HANDOVER_CANCEL_MSG)
        with pytest.raises(asyncio.CancelledError) if cancel else nullcontext():
            await task

    with capture_logs() as captured:
        asyncio.run(run())
    return [entry["event"] for entry in captured]


def test_a_coroutine_that_fired_leaves_out_trigger_completed() -> None:
    assert _lines_of(_Trigger(events=1)) == [STARTING, "Trigger fired event"]


def test_a_coroutine_that_ended_without_an_event_says_completed() -> None:
    assert _lines_of(_Trigger(events=0)) == [STARTING, "trigger completed"]


def test_a_cancelled_coroutine_says_completed_even_after_firing() -> None:
    """A watcher fires and keeps running; cancelled at a handover, its log still says it ended."""
    lines = _lines_of(_Trigger(events=2, forever=True), cancel=True)
    assert lines == [STARTING, "Trigger fired event", "Trigger fired event", "trigger completed"]


def test_a_fired_line_is_sent_at_once_other_lines_wait_for_the_loop() -> None:
    """The runner batches its log lines (docs/design.md, runner: The log channel) but sends a "Trigger
    fired event" line at once:
    an instance killed before its next sync still leaves in its log what it fired."""
    drains: list[int] = []

    class _Channel:
        def drain(self) -> None:
            drains.append(1)

    async def run() -> None:
        runner = SmartTriggerRunner()
        runner.log_channel = _Channel()  # type: ignore[assignment]
        trigger = _Trigger(events=2)
        task = asyncio.create_task(runner.run_trigger(1, trigger))
        runner.triggers[1] = {"task": task, "is_watcher": False, "name": NAME, "events": 0}
        await task

    with capture_logs():
        asyncio.run(run())
    assert len(drains) == 2  # one per fired line; "starting" waits for the loop's pass


@pytest.mark.parametrize("otel_on", [False, True])
def test_untraced_coroutines_share_one_no_op_span(monkeypatch: pytest.MonkeyPatch, otel_on: bool) -> None:
    """Tracing off: run_trigger gets a non-recording span without Airflow's per-coroutine context work, and
    still runs its trigger to the end; tracing on: Airflow's spans are left as they are."""
    from airflow.jobs import triggerer_job_runner
    from opentelemetry import trace

    from smart_triggerer.runner.trigger_runner import skip_untraced_spans

    airflows = triggerer_job_runner._make_trigger_span
    monkeypatch.setattr(triggerer_job_runner, "_make_trigger_span", airflows)  # restored after the test
    monkeypatch.setenv("AIRFLOW__TRACES__OTEL_ON", str(otel_on))
    assert skip_untraced_spans() is not otel_on
    assert (triggerer_job_runner._make_trigger_span is airflows) is otel_on
    if not otel_on:
        with triggerer_job_runner._make_trigger_span(ti=None, trigger_id=1, name=NAME) as span:
            assert span is trace.INVALID_SPAN and not span.is_recording()
    assert _lines_of(_Trigger(events=1)) == [STARTING, "Trigger fired event"]


JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ0YXNrIn0.c2lnbmF0dXJl"  # a token's shape: three base64 parts


@pytest.mark.parametrize(
    "value",
    [
        "trigger dag/run/task/-1/1 (ID 7) starting",
        JWT,
        f"Bearer {JWT} expired",
        f"{JWT} and {JWT}",
        "eyJ",
        "xeyJy",
        "EYJ not a token",
        "",
        42,
        None,
        {"token": JWT},
        [JWT],
        type("Name", (str,), {})("a str subclass"),  # comes back a plain str, as from Airflow's
    ],
)
def test_the_quick_jwt_redaction_gives_airflows_output(value: object) -> None:
    from airflow.sdk._shared.logging.structlog import redact_jwt

    from smart_triggerer.runner.trigger_runner import redact_jwt_quickly

    ours = redact_jwt_quickly(None, "info", {"event": value, "other": value})
    airflows = redact_jwt(None, "info", {"event": value, "other": value})
    assert ours == airflows
    assert [type(v) for v in ours.values()] == [type(v) for v in airflows.values()]


_QUICK_REDACTION = """
import json, sys
import structlog
from airflow.sdk._shared.logging.structlog import redact_jwt
from airflow.sdk.log import configure_logging
from smart_triggerer.runner.trigger_runner import quick_jwt_redaction, redact_jwt_quickly

JWT = sys.argv[1]
with open(sys.argv[2], "wb", buffering=0) as sink:
    configure_logging(json_output=True, output=sink, sending_to_supervisor=True)
    made_before = structlog.get_logger(logger_name="test.runner")
    assert redact_jwt in structlog.get_config()["processors"]
    assert quick_jwt_redaction() == 1
    processors = structlog.get_config()["processors"]
    assert redact_jwt not in processors and redact_jwt_quickly in processors
    made_before.info("the token %s", JWT, header=f"Bearer {JWT}")
"""


def test_the_runner_redacts_tokens_with_the_quick_processor(tmp_path: Any) -> None:
    """Replaced in the configured chain, in place: a logger made before uses it too, and a token in a line
    is still redacted. In a process of its own: the runner's logging set-up is global."""
    import json
    import subprocess
    import sys

    out = tmp_path / "lines.json"
    done = subprocess.run(
        [sys.executable, "-c", _QUICK_REDACTION, JWT, str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(out.read_text().splitlines()[-1])
    assert line["event"] == "the token eyJ***" and line["header"] == "Bearer eyJ***"
    assert JWT not in out.read_text()
