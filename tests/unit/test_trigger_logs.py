"""Trigger log files through a bounded pool of open descriptors
(``smart_triggerer/supervisor/trigger_logs.py``)."""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import stat
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog
from airflow.jobs.triggerer_job_runner import TriggerLoggingFactory

from smart_triggerer.supervisor import trigger_logs
from smart_triggerer.supervisor.trigger_logs import (
    MAX_OPEN_LOG_FILES,
    LogFilePool,
    PooledLogFile,
    PooledTriggerLoggingFactory,
    open_files_allowed,
)


def test_lines_reach_every_file_in_order_with_at_most_limit_open(tmp_path: Path) -> None:
    pool = LogFilePool(limit=3)
    paths = [tmp_path / f"t{n}.log" for n in range(7)]
    paths[0].write_bytes(b"a previous run's lines\n")  # the first open truncates, as Airflow's does
    files = [PooledLogFile(path, pool) for path in paths]
    most_open = 0
    for line in range(5):
        for n, log_file in enumerate(files):
            log_file.write(f"file {n} line {line}\n".encode())
            log_file.flush()
            most_open = max(most_open, len(pool))
    assert most_open == 3
    for n, path in enumerate(paths):
        assert path.read_text().splitlines() == [f"file {n} line {line}" for line in range(5)]


def test_a_closed_file_gives_back_its_descriptor_and_refuses_writes(tmp_path: Path) -> None:
    pool = LogFilePool(limit=2)
    log_file = PooledLogFile(tmp_path / "t.log", pool)
    log_file.write(b"one\n")
    assert log_file.fileno() > 2 and len(pool) == 1
    log_file.close()
    assert log_file.closed and len(pool) == 0
    with pytest.raises(ValueError, match="closed log file"):
        log_file.write(b"two\n")
    assert (tmp_path / "t.log").read_text() == "one\n"


def test_the_factory_writes_airflow_json_lines_through_the_pool(tmp_path: Path) -> None:
    pool = LogFilePool(limit=1)
    made = TriggerLoggingFactory(log_path=str(tmp_path / "a" / "attempt=1.log.trigger.7.log"), ti=None)  # type: ignore[arg-type]  # no task instance
    factories = [
        PooledTriggerLoggingFactory.replacing(made, pool),
        PooledTriggerLoggingFactory(log_path=str(tmp_path / "b.log.trigger.7.log"), ti=None, pool=pool),  # type: ignore[arg-type]
    ]
    processors = [structlog.processors.JSONRenderer(), lambda _l, _m, text: text.encode()]
    loggers = [factory(processors) for factory in factories]
    assert factories[0](processors) is loggers[0]  # one logger per trigger, as Airflow's
    for n in range(3):
        for logger in loggers:
            logger.info("line", n=n)
    assert len(pool) == 1
    for factory in factories:
        lines = [json.loads(line) for line in Path(factory.log_path).read_text().splitlines()]
        assert [line["n"] for line in lines] == [0, 1, 2]
        factory.close()
    assert len(pool) == 0


def test_the_pool_takes_at_most_a_quarter_of_the_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"soft": 100}
    monkeypatch.setattr(trigger_logs.resource, "getrlimit", lambda _which: (limits["soft"], 1 << 20))  # type: ignore[attr-defined]
    assert open_files_allowed() == 25
    limits["soft"] = 20_000
    assert open_files_allowed() == MAX_OPEN_LOG_FILES
    limits["soft"] = resource.RLIM_INFINITY
    assert open_files_allowed() == MAX_OPEN_LOG_FILES


def test_a_removed_folder_is_made_again_and_an_unwritable_file_drops_lines(tmp_path: Path) -> None:
    """Log retention may remove a waiting trigger's folder while its file is closed to make room; a line
    that cannot be written at all is dropped: neither may stop the supervisor."""
    pool = LogFilePool(limit=1)
    folder = tmp_path / "dag_id=d"
    folder.mkdir()
    waiting = PooledLogFile(folder / "t.log", pool)
    waiting.write(b"starting\n")
    other = PooledLogFile(tmp_path / "other.log", pool)
    other.write(b"closes the waiting trigger's file\n")
    shutil.rmtree(folder)
    assert waiting.write(b"fired\n") == len(b"fired\n")
    waiting.flush()  # as structlog's BytesLogger does after every line
    assert (folder / "t.log").read_text() == "fired\n"

    blocked = PooledLogFile(tmp_path / "a-folder" / "t.log", pool)
    (tmp_path / "a-folder").write_text("a file where the folder should be")
    assert blocked.write(b"lost\n") == 0
    assert len(pool) == 1 and other.write(b"still written\n") > 0  # the failed open closed nothing else


class FakeRemoteLogs:
    """What Airflow's ``upload_to_remote`` hands the configured remote log handler."""

    def __init__(self) -> None:
        self.uploaded: list[str] = []

    def upload(self, path: str, ti: object) -> None:
        self.uploaded.append(path)


@pytest.mark.parametrize("held", [False, True], ids=["written at once", "held until the upload"])
def test_remote_log_upload_finds_the_pooled_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """Airflow's upload reads the path from the factory's logger's file (``relative_path_from_logger``),
    whether the trigger's lines were written as they came or were still held when it ended."""
    import airflow.sdk.log

    remote = FakeRemoteLogs()
    monkeypatch.setattr(airflow.sdk.log, "load_remote_log_handler", lambda: remote)
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path))
    pool = LogFilePool(limit=1)
    pool.holding = held
    factory = PooledTriggerLoggingFactory(
        log_path=str(tmp_path / "dag_id=d" / "t.log.trigger.7.log"),
        ti=None,  # type: ignore[arg-type]
        pool=pool,
    )
    factory([lambda _l, _m, event: json.dumps(event).encode()]).log(20, "line")
    other = PooledLogFile(tmp_path / "other.log", pool)
    other.write(b"evicts the trigger's file\n")
    factory.upload_to_remote()
    assert remote.uploaded == ["dag_id=d/t.log.trigger.7.log"]
    assert "line" in (tmp_path / "dag_id=d" / "t.log.trigger.7.log").read_text()


def test_an_ended_factory_is_freed_at_once_not_left_to_the_collector(tmp_path: Path) -> None:
    """Thousands of coroutines end at a handover: their factories (and what they hold) must go with the
    last reference, not wait for a full collection."""
    pool = LogFilePool(limit=1)
    pool.holding = True
    factory = PooledTriggerLoggingFactory(log_path=str(tmp_path / "t.log"), ti=None, pool=pool)  # type: ignore[arg-type]
    factory([lambda _l, _m, event: json.dumps(event).encode()]).log(20, "starting")
    pool.write_held(budget_seconds=60)
    factory.upload_to_remote()
    factory.close()
    watched = weakref.ref(factory)
    gc.disable()
    try:
        del factory
        assert watched() is None
    finally:
        gc.enable()


def test_a_factory_that_wrote_nothing_uploads_and_closes_without_error(tmp_path: Path) -> None:
    """A coroutine handed over before its first line has a factory but no file: ending it (upload, then
    close, as the supervisor does) must neither fail nor make a file."""
    pool = LogFilePool(limit=1)
    factory = PooledTriggerLoggingFactory(
        log_path=str(tmp_path / "dag_id=d" / "t.log.trigger.7.log"),
        ti=None,  # type: ignore[arg-type]
        pool=pool,
    )
    factory.upload_to_remote()
    factory.close()
    assert not (tmp_path / "dag_id=d").exists() and len(pool) == 0


def test_files_are_made_at_the_first_line_under_the_base_folder_with_airflows_permissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is created by its first open (no separate touch), where Airflow's init_log_file would put
    it, with ``file_task_handler_new_file_permissions``; a missing folder is made with the folder's."""
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__LOGGING__FILE_TASK_HANDLER_NEW_FILE_PERMISSIONS", "0o640")
    monkeypatch.setenv("AIRFLOW__LOGGING__FILE_TASK_HANDLER_NEW_FOLDER_PERMISSIONS", "0o750")
    previous_umask = os.umask(0o022)
    try:
        pool = LogFilePool(limit=4)
        relative = "dag_id=d/run_id=r/task_id=t/attempt=1.log.trigger.7.log"
        factory = PooledTriggerLoggingFactory(log_path=relative, ti=None, pool=pool)  # type: ignore[arg-type]
        logger = factory([lambda _l, _m, event: json.dumps(event).encode()])
        assert not (tmp_path / relative).exists()  # nothing made before a line comes
        logger.info("trigger starting")
        made = tmp_path / relative
        assert json.loads(made.read_text())["event"] == "trigger starting"
        assert stat.S_IMODE(made.stat().st_mode) == 0o640
        assert stat.S_IMODE(made.parent.stat().st_mode) == 0o750
    finally:
        os.umask(previous_umask)


def files_made_in_order(monkeypatch: pytest.MonkeyPatch) -> list[PooledLogFile]:
    """The files whose held lines are written, in the order they are (filled as the test goes on)."""
    made: list[PooledLogFile] = []
    make = PooledLogFile.write_held
    monkeypatch.setattr(PooledLogFile, "write_held", lambda self: (made.append(self), make(self))[1])  # type: ignore[func-returns-value]
    return made


def test_held_lines_are_written_first_in_order_when_their_files_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a takeover hands out coroutines the pool holds the lines of files not made yet; each file is
    then made with its lines in order, by ``write_held`` or by its close. A line after the hold is held
    too (making thousands of files at once stopped the supervisor's loop), and its file is made first."""
    pool = LogFilePool(limit=2)
    files = [PooledLogFile(tmp_path / f"t{n}.log", pool) for n in range(4)]
    pool.holding = True
    for n, log_file in enumerate(files):
        log_file.write(f"t{n} starting\n".encode())
        log_file.flush()
    files[0].write(b"t0 second line\n")
    assert not any(Path(f.name).exists() for f in files) and len(pool.held) == 4
    pool.holding = False
    files[1].write(b"t1 fired\n")  # a line after the hold: held behind the first, its file made first
    files[1].flush()
    assert not Path(files[1].name).exists()
    files[2].close()  # ended before its file was made
    assert list(pool.held) == [files[0], files[1], files[3]]
    made = files_made_in_order(monkeypatch)
    assert pool.write_held(budget_seconds=60) is False and not pool.held and not pool.sooner
    assert made == [files[1], files[0], files[3]]  # the one with news first
    files[3].write(b"t3 fired\n")
    for log_file in files:
        log_file.flush()
    assert [Path(f.name).read_text().splitlines() for f in files] == [
        ["t0 starting", "t0 second line"],
        ["t1 starting", "t1 fired"],
        ["t2 starting"],
        ["t3 starting", "t3 fired"],
    ]


def test_write_held_stops_at_its_budget_and_keeps_the_rest_in_order(tmp_path: Path) -> None:
    pool = LogFilePool(limit=8)
    pool.holding = True
    files = [PooledLogFile(tmp_path / f"t{n}.log", pool) for n in range(5)]
    for log_file in files:
        log_file.write(b"starting\n")
    assert pool.write_held(budget_seconds=0) is True and list(pool.held) == files  # nothing in no time
    pool.holding = False
    assert pool.write_held(budget_seconds=60) is False
    assert all(Path(f.name).read_text() == "starting\n" for f in files)


def test_held_lines_of_a_file_that_cannot_be_made_are_dropped_without_stopping_the_rest(
    tmp_path: Path,
) -> None:
    pool = LogFilePool(limit=4)
    pool.holding = True
    (tmp_path / "not-a-folder").write_text("a file where the folder should be")
    blocked = PooledLogFile(tmp_path / "not-a-folder" / "t.log", pool)
    fine = PooledLogFile(tmp_path / "t.log", pool)
    blocked.write(b"lost\n")
    fine.write(b"kept\n")
    pool.holding = False
    assert pool.write_held(budget_seconds=60) is False and not pool.held
    assert (tmp_path / "t.log").read_text() == "kept\n"


def test_runner_lines_are_held_unprocessed_and_processed_in_order_when_the_file_is_made(
    tmp_path: Path,
) -> None:
    """While the pool holds, Airflow's ``log(level, event, **kw)`` calls for a file not made yet are kept
    as they came: the processors (masking, rendering) run only when the file is made, in order with any
    line written after the hold, and the runner's own timestamp is the one written."""
    processed: list[str] = []

    def renderer(_logger: object, _method: str, event: dict[str, object]) -> bytes:
        processed.append(str(event["event"]))
        return json.dumps(event).encode()

    pool = LogFilePool(limit=4)
    factory = PooledTriggerLoggingFactory(log_path=str(tmp_path / "t.log"), ti=None, pool=pool)  # type: ignore[arg-type]
    logger = factory([renderer])
    pool.holding = True
    logger.log(20, "trigger starting", timestamp="2026-01-01T00:00:00Z")
    logger.log(20, "polling", n=1)
    assert processed == [] and not Path(factory.log_path).exists() and list(pool.held)
    assert factory._holding_logger.made is None  # structlog's logger too is made only when the file is
    pool.holding = False
    logger.log(20, "fired", n=2)  # after the hold: held behind the others, processed when the file is made
    assert processed == [] and list(pool.sooner)
    assert pool.write_held(budget_seconds=60) is False
    assert processed == ["trigger starting", "polling", "fired"]
    lines = [json.loads(line) for line in Path(factory.log_path).read_text().splitlines()]
    assert [line["event"] for line in lines] == processed
    assert lines[0]["timestamp"] == "2026-01-01T00:00:00Z"
    assert not pool.held
    assert factory([renderer]) is logger and logger.made is not None  # one of each per factory


def test_held_calls_reach_the_file_before_an_upload_and_a_bad_one_is_dropped_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploaded: list[str] = []
    monkeypatch.setattr(
        TriggerLoggingFactory,
        "upload_to_remote",
        lambda self: uploaded.append(Path(self.log_path).read_text()),
    )

    def renderer(_logger: object, _method: str, event: dict[str, object]) -> bytes:
        if event.get("bad"):
            raise ValueError("cannot render")
        return f"{event['event']}\n".encode()[:-1]

    pool = LogFilePool(limit=4)
    pool.holding = True
    factory = PooledTriggerLoggingFactory(log_path=str(tmp_path / "t.log"), ti=None, pool=pool)  # type: ignore[arg-type]
    logger = factory([renderer])
    logger.log(20, "starting")
    logger.log(20, "broken", bad=True)
    logger.log(20, "fired")
    factory.upload_to_remote()  # the coroutine ended while its lines were still held
    assert uploaded == ["starting\nfired\n"]
    factory.close()
    assert not pool.held


def test_the_pool_knows_when_a_new_file_last_got_a_held_line(tmp_path: Path) -> None:
    """The supervisor holds while files not made yet keep getting their first lines (a runner given
    thousands of coroutines at once runs their first steps for seconds after it reported them)."""
    pool = LogFilePool(limit=4)
    pool.holding = True
    first, second = PooledLogFile(tmp_path / "a.log", pool), PooledLogFile(tmp_path / "b.log", pool)
    first.write(b"starting\n")
    stamped = pool.new_file_held_at
    assert stamped > float("-inf")
    first.write(b"second line of the same file\n")
    assert pool.new_file_held_at == stamped  # not a new file
    pool.new_file_held_at = float("-inf")
    second.write(b"starting\n")
    assert pool.new_file_held_at >= stamped


def test_a_closed_file_holds_its_lines_while_files_wait_to_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handover cancels thousands of coroutines, each with a last line for a file the pool closed: while
    files wait to be made, those lines wait too (reopening each in the log path stopped the loop), and its
    file is written first; with nothing waiting, a line is written at once, reopening the file."""
    monkeypatch.setattr(trigger_logs, "REOPEN_SECONDS", 3600.0)  # the reopening budget is not under test
    pool = LogFilePool(limit=1)
    made, waiting = PooledLogFile(tmp_path / "made.log", pool), PooledLogFile(tmp_path / "waiting.log", pool)
    made.write(b"starting\n")
    PooledLogFile(tmp_path / "other.log", pool).write(b"starting\n")  # closes made.log (limit 1)
    assert not pool.is_open(made)
    pool.holding = True
    waiting.write(b"starting\n")
    pool.holding = False
    made.write(b"trigger completed\n")
    made.flush()
    assert Path(made.name).read_text() == "starting\n"  # held, not reopened
    assert list(pool.held) == [waiting, made] and list(pool.sooner) == [made]
    assert pool.write_held(budget_seconds=60) is False
    assert Path(made.name).read_text() == "starting\ntrigger completed\n"
    assert Path(waiting.name).read_text() == "starting\n"
    made.write(b"again\n")  # nothing waits: written at once
    made.flush()
    assert Path(made.name).read_text() == "starting\ntrigger completed\nagain\n" and not pool.held


def closed_files(tmp_path: Path, pool: LogFilePool, count: int) -> list[PooledLogFile]:
    """``count`` made files, all closed again by the pool (its limit is 1: the last one made stays open)."""
    files = [PooledLogFile(tmp_path / f"f{n}.log", pool) for n in range(count + 1)]
    for log_file in files:
        log_file.write(b"starting\n")
    return files[:-1]


def test_reopening_from_the_log_path_stops_at_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing waiting to be made, lines of closed files are written at once until this window's
    reopening time is spent (a handover after every file was made: thousands of last lines), then wait."""
    pool = LogFilePool(limit=1)
    first, second, third = closed_files(tmp_path, pool, 3)
    monkeypatch.setattr(trigger_logs, "REOPEN_SECONDS", 0.0)  # spent by one reopen
    monkeypatch.setattr(trigger_logs, "REOPEN_WINDOW_SECONDS", 3600.0)
    pool._reopen_window = (-float("inf"), 0.0)
    first.write(b"completed\n")  # the window's first reopen: at once
    second.write(b"completed\n")
    third.write(b"completed\n")
    first.flush()
    assert Path(first.name).read_text() == "starting\ncompleted\n"
    assert list(pool.held) == [second, third] and Path(second.name).read_text() == "starting\n"
    assert pool.write_held(budget_seconds=60) is False
    for log_file in (second, third):
        log_file.flush()
    assert [Path(f.name).read_text() for f in (second, third)] == ["starting\ncompleted\n"] * 2


def test_on_the_way_out_and_past_the_backlog_limit_lines_are_written_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = LogFilePool(limit=1)
    closed, other = closed_files(tmp_path, pool, 2)
    pool.holding = True
    waiting = PooledLogFile(tmp_path / "waiting.log", pool)
    waiting.write(b"starting\n")
    pool.holding = False
    monkeypatch.setattr(trigger_logs, "MAX_WAITING_FILES", 1)  # one file waits already: the writer lags
    closed.write(b"completed\n")
    closed.flush()
    assert Path(closed.name).read_text() == "starting\ncompleted\n"
    monkeypatch.setattr(trigger_logs, "MAX_WAITING_FILES", 10_000)
    pool.exiting = True  # nothing would write it later
    other.write(b"completed\n")
    waiting.write(b"completed\n")
    for log_file in (other, waiting):
        log_file.flush()
    assert Path(other.name).read_text() == "starting\ncompleted\n"
    assert Path(waiting.name).read_text() == "starting\ncompleted\n" and not pool.held


def test_files_with_news_do_not_starve_files_holding_only_their_first_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = LogFilePool(limit=1)
    pool.holding = True
    quiet = [PooledLogFile(tmp_path / f"quiet{n}.log", pool) for n in range(2)]
    busy = [PooledLogFile(tmp_path / f"busy{n}.log", pool) for n in range(4)]
    for log_file in [*quiet, *busy]:
        log_file.write(b"starting\n")
    pool.holding = False
    for log_file in busy:
        log_file.write(b"fired\n")  # news after the hold
    made = files_made_in_order(monkeypatch)
    assert pool.write_held(budget_seconds=60) is False
    assert made == [busy[0], quiet[0], busy[1], quiet[1], busy[2], busy[3]]


def test_a_file_that_fails_to_close_when_evicted_costs_the_next_file_nothing(tmp_path: Path) -> None:
    """Closing the least recently written file to make room flushes what it still buffers; if that fails,
    the loss is that file's (said once), and the file being opened gets its line."""
    from structlog.testing import capture_logs

    pool = LogFilePool(limit=1)
    first = PooledLogFile(tmp_path / "first.log", pool)
    first.write(b"written\n")
    first.flush()
    pool._open[first] = RefusingClose(pool.handle(first))  # type: ignore[assignment]  # a full disk
    second = PooledLogFile(tmp_path / "second.log", pool)
    with capture_logs() as logs:
        assert second.write(b"line\n") == len(b"line\n")
        second.flush()
    assert (tmp_path / "second.log").read_text() == "line\n"
    assert [(line["event"], line["path"]) for line in logs] == [
        ("cannot close a trigger log file; its last lines are dropped", str(tmp_path / "first.log"))
    ]


class RefusingClose:
    """An open log file whose last flush, at close, the disk refuses (the descriptor is closed all the
    same, as Python's own file objects do)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def close(self) -> None:
        self.handle.close()
        raise OSError(28, "No space left on device")


def test_past_the_byte_cap_held_lines_are_written_at_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trigger that logs a lot while its file waits (a takeover's hold) must not grow the supervisor
    without end: past ``MAX_HELD_BYTES`` held in all, a line is written at once, after what its file held."""
    monkeypatch.setattr(trigger_logs, "MAX_HELD_BYTES", 100)
    pool = LogFilePool(limit=4)
    pool.holding = True
    chatty = PooledLogFile(tmp_path / "chatty.log", pool)
    quiet = PooledLogFile(tmp_path / "quiet.log", pool)
    quiet.write(b"starting\n")
    lines = [f"poll {n:03}\n".encode() for n in range(20)]  # 9 bytes each
    for line in lines[:10]:
        chatty.write(line)
    assert pool.held_bytes == 9 + 90 and not Path(chatty.name).exists()  # under the cap: all held
    chatty.write(lines[10])  # 108 bytes held: the cap is reached, the next line is not held
    chatty.write(lines[11])
    chatty.flush()
    assert Path(chatty.name).read_bytes() == b"".join(lines[:12])
    assert pool.held_bytes == 9  # only the quiet file's first line is still held
    quiet.write(b"completed\n")  # over the cap no more: held as before
    assert pool.held_bytes == 19 and not Path(quiet.name).exists()
    pool.holding = False
    assert not pool.write_held(1.0)
    assert Path(quiet.name).read_text() == "starting\ncompleted\n" and pool.held_bytes == 0
