"""The supervisor in parts (``smart_triggerer/supervisor/``): each part owns its job, the conductor has them
all."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from smart_triggerer.config import Settings
from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
from smart_triggerer.supervisor.shared import Shared
from smart_triggerer.supervisor.state import SupervisorState

PACKAGE = Path(inspect.getfile(SupervisorState)).parent


def shared() -> Shared:
    """What the parts share, with default settings and no group yet."""
    return Shared(settings=Settings(), capacity=1000)


def test_every_call_between_parts_is_implemented_by_a_part() -> None:
    declared = [
        name
        for name, value in vars(SupervisorState).items()
        if callable(value) and "NotImplementedError" in inspect.getsource(value)
    ]
    assert declared, "the state names the calls parts make into each other"
    for name in declared:
        owner = next(cls for cls in SmartTriggerRunnerSupervisor.__mro__ if name in vars(cls))
        assert owner is not SupervisorState, f"{name} is declared on the state but no part implements it"
        assert owner.__module__.startswith("smart_triggerer.supervisor."), owner


def conductor_as_each_instance(conductor: SmartTriggerRunnerSupervisor) -> list[object]:
    """mypy checks that the conductor is each part's ``Instance`` (the parts are built in attrs factories,
    where ``self`` is not typed): a missing or misspelled answer fails the fast lane's type check."""
    from smart_triggerer.supervisor import events, feed, handover, housekeeping, leases, stall, starting

    answers: tuple[
        events.Instance,
        feed.Instance,
        handover.Instance,
        housekeeping.Instance,
        leases.Instance,
        stall.Instance,
        starting.Instance,
    ] = (conductor, conductor, conductor, conductor, conductor, conductor, conductor)
    return list(answers)


def test_the_conductor_answers_everything_each_part_asks_of_the_instance() -> None:
    from smart_triggerer.supervisor import events, feed, handover, housekeeping, leases, stall, starting

    for part in (events, feed, handover, housekeeping, leases, stall, starting):
        protocol = part.Instance
        asked = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
        assert asked, part.__name__
        missing = {n for n in asked if not hasattr(SmartTriggerRunnerSupervisor, n)}
        # attributes (health_url) are the conductor's attrs fields: set per instance, declared on the class
        fields = {f.name for f in SmartTriggerRunnerSupervisor.__attrs_attrs__}
        assert missing <= fields, f"{part.__name__} asks the instance for {sorted(missing - fields)}"


def test_no_part_is_over_500_lines_and_each_says_what_it_owns() -> None:
    for module in sorted(PACKAGE.glob("*.py")):
        text = module.read_text()
        assert len(text.splitlines()) <= 500, module.name
        assert text.startswith('"""'), f"{module.name} has no docstring saying what it owns"


def test_a_log_channel_read_through_during_a_request_never_blocks_the_loop() -> None:
    """Airflow's loop selects, then calls each ready socket's reader, whose ``recv`` blocks. A runner
    request whose handling reads the log channel through (coroutines ended) emptied a socket the same
    select had reported ready; the loop then blocked on it while the runner waited for its next answer."""
    import selectors
    import socket
    import threading

    from smart_triggerer.supervisor.runner_comms import RunnerComms

    runner_end, supervisor_end = socket.socketpair()
    received = bytearray()

    def read(sock: socket.socket) -> bool:  # as Airflow's reader: one blocking recv
        data = sock.recv(4096)
        received.extend(data)
        return bool(data)

    with runner_end, supervisor_end, selectors.DefaultSelector() as selector:
        selector.register(supervisor_end, selectors.EVENT_READ, (read, lambda sock: None))
        supervisor = SimpleNamespace(selector=selector, _open_sockets={supervisor_end: "logs"})
        supervisor._log_keys = lambda: RunnerComms._log_keys(supervisor)  # type: ignore[arg-type]
        RunnerComms._guard_log_reads(supervisor)  # type: ignore[arg-type]  # what run_once does first
        runner_end.sendall(b"Trigger fired event\n")
        ready = selector.select(0)  # Airflow's select: the log channel is ready
        RunnerComms._read_sent_log_lines(supervisor)  # type: ignore[arg-type]  # a request read it through
        assert bytes(received) == b"Trigger fired event\n"
        finished = threading.Event()

        def stale_read() -> None:  # the loop goes on to the ready socket it selected before
            for key, _ in ready:
                key.data[0](key.fileobj)
            finished.set()

        threading.Thread(target=stale_read, daemon=True).start()
        assert finished.wait(5), "the loop blocked on a log channel already read through"
        runner_end.sendall(b"next line\n")  # later lines still arrive
        for key, _ in selector.select(1):
            key.data[0](key.fileobj)
        assert bytes(received) == b"Trigger fired event\nnext line\n"


def test_a_pass_of_the_loop_reads_the_log_channel_through_in_4_kb_reads_up_to_a_bound() -> None:
    """Airflow reads the runner's log channel 4 KB per pass of its loop: a takeover's first lines took
    1,200 passes. One pass now reads what is there, up to ``LOG_READS_PER_PASS`` reads (the loop's other
    sockets are served after it), and a closed channel is still reported closed. A request's read-through
    (``_read_sent_log_lines``) still counts Airflow's 4 KB reads: ``LOG_READS_BEFORE_FINISHING`` at most."""
    import selectors
    import socket

    from smart_triggerer.supervisor.runner_comms import LOG_READS_BEFORE_FINISHING, RunnerComms
    from smart_triggerer.supervisor.trigger_logs import LOG_READS_PER_PASS, reading_only_ready

    runner_end, supervisor_end = socket.socketpair()
    received = bytearray()
    calls = 0

    def read(sock: socket.socket) -> bool:  # as Airflow's reader: one blocking recv of 4 KB
        nonlocal calls
        calls += 1
        data = sock.recv(4096)
        received.extend(data)
        return bool(data)

    with runner_end, supervisor_end:
        runner_end.settimeout(5)  # a socket buffer smaller than the test's bytes fails, never hangs
        sent = b"x" * (20 * 4096 + 10)  # within Linux's default socket buffer: all there before the pass
        runner_end.sendall(sent)
        assert reading_only_ready(read)(supervisor_end) is True
        assert bytes(received) == sent and calls == 21  # one pass, every read while data was there
        assert reading_only_ready(read)(supervisor_end) is True and calls == 21  # nothing there: no read
        runner_end.close()
        assert reading_only_ready(read)(supervisor_end) is False  # closed: Airflow's loop closes it

    calls = 0
    runner_end, supervisor_end = socket.socketpair()

    def read_without_taking(sock: socket.socket) -> bool:  # the channel never empties
        nonlocal calls
        calls += 1
        return True

    with runner_end, supervisor_end:
        runner_end.sendall(b"line\n")
        assert reading_only_ready(read_without_taking)(supervisor_end) is True
        assert calls == LOG_READS_PER_PASS  # bounded: the loop goes on to its other sockets

        calls = 0
        with selectors.DefaultSelector() as selector:  # as the loop installs it, then a request reads through
            selector.register(supervisor_end, selectors.EVENT_READ, (read_without_taking, lambda sock: None))
            supervisor = SimpleNamespace(selector=selector, _open_sockets={supervisor_end: "logs"})
            supervisor._log_keys = lambda: RunnerComms._log_keys(supervisor)  # type: ignore[arg-type]
            RunnerComms._guard_log_reads(supervisor)  # type: ignore[arg-type]
            RunnerComms._read_sent_log_lines(supervisor)  # type: ignore[arg-type]
        assert calls == LOG_READS_BEFORE_FINISHING  # Airflow's reads, not passes of 64 each


def test_run_once_wraps_the_log_reader_before_anything_else() -> None:
    """A load or a start services the runner's sockets itself (feed.py, starting.py): on the very first
    pass too, Airflow's blocking log reader must be wrapped before (``_guard_log_reads``)."""
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor

    class Stop(Exception):
        pass

    calls: list[str] = []

    def guard_leases() -> None:
        calls.append("leases")
        raise Stop  # the rest of the pass needs a whole supervisor: the order so far is what is checked

    supervisor = object.__new__(SmartTriggerRunnerSupervisor)
    supervisor._guard_log_reads = lambda: calls.append("log reads")  # type: ignore[method-assign]
    supervisor.leases = SimpleNamespace(guard=guard_leases)  # type: ignore[assignment]
    with pytest.raises(Stop):
        supervisor.run_once()
    assert calls == ["log reads", "leases"]


def test_the_collector_is_held_while_a_big_start_is_under_way_and_released_when_it_is_over() -> None:
    """``Starting.hold_collector`` (called by every loop and every start pass): held from ``FREEZE_FROM``
    groups waiting to start while groups wait, workloads wait to be built or a phased takeover's shards
    wait to be read, or a big hand-out's first log lines are still held; released once none does."""
    import gc

    from smart_triggerer.runner.collector import FREEZE_FROM, NO_OLDER_COLLECTIONS
    from smart_triggerer.supervisor.deadlines import MemberDeadlines
    from smart_triggerer.supervisor.feed import Feed
    from smart_triggerer.supervisor.handover import Handover
    from smart_triggerer.supervisor.log_files import LogFiles
    from smart_triggerer.supervisor.starting import Starting

    context = Shared(settings=Settings(), capacity=10 * FREEZE_FROM, owned={1, 2})
    instance = cast("Any", SimpleNamespace())  # a stand-in the collector's hold never asks anything of
    deadlines = MemberDeadlines(context)
    log_files = LogFiles(context, running=set, start_under_way=lambda: False, logger_cache={})
    part = Starting(
        context,
        instance,
        feed=Feed(context, deadlines, instance),
        deadlines=deadlines,
        handover=Handover(context, instance),
        log_files=log_files,
    )
    thresholds = gc.get_threshold()
    try:
        for member in range(FREEZE_FROM):
            context.groups.join(member, identity_hash=member)
        part.hold_collector()
        assert gc.get_threshold()[1:] == (NO_OLDER_COLLECTIONS, NO_OLDER_COLLECTIONS)
        for group in list(context.groups.unstarted.values()):
            context.groups.start(group)
        part.build_backlog, part.feed.to_read = True, {2}  # started, not all built; a phase to read
        part.hold_collector()
        assert gc.get_threshold()[1] == NO_OLDER_COLLECTIONS
        part.build_backlog = False
        part.hold_collector()
        assert gc.get_threshold()[1] == NO_OLDER_COLLECTIONS  # shard 2 still to read
        part.feed.to_read, log_files.pool.holding = set(), True
        part.hold_collector()
        assert gc.get_threshold()[1] == NO_OLDER_COLLECTIONS  # the runner still makes their first lines
        log_files.pool.holding = False
        part.hold_collector()
        assert gc.get_threshold() == thresholds
    finally:
        gc.set_threshold(*thresholds)


def test_first_log_lines_stay_held_while_a_sweep_or_a_phased_takeover_has_more_to_hand_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LogFiles.pace`` (on a clock of the test's): between two loops of a cold start every group read
    so far may be running; a hold begun by a big hand-out goes on while the sweep's pass hashes on or shards
    of this instance wait to be read."""
    from smart_triggerer.supervisor import log_files

    clock = FakeClock(monkeypatch)
    supervisor = pacing_supervisor()
    supervisor.files.pace()
    assert not supervisor.files.pool.holding  # nothing handed out: a start under way begins no hold

    hand_out(supervisor, log_files.HOLD_LOG_LINES_FROM)  # the first read: a big hand-out begins the hold
    supervisor.files.pace()
    assert supervisor.files.pool.holding
    all_running(supervisor)
    clock.now += 10 * log_files.HELD_LOG_LINES_SECONDS
    supervisor.files.pace()
    assert supervisor.files.pool.holding  # nothing left to run, but the sweep goes on
    supervisor.hash_xmin, supervisor.sweep_after, supervisor.to_read = "100", 0, {2, 3}
    clock.now += 10 * log_files.HELD_LOG_LINES_SECONDS
    supervisor.files.pace()
    assert supervisor.files.pool.holding  # swept; shard 2, ours, still to read
    supervisor.to_read = {3}  # not ours: nothing of this instance's start is left
    supervisor.files.pace()
    assert supervisor.files.pool.holding  # the grace after the last hand-out
    clock.now += log_files.HELD_LOG_LINES_SECONDS
    supervisor.files.pace()
    assert not supervisor.files.pool.holding


def test_a_sweep_that_does_not_end_holds_first_log_lines_no_longer_than_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep's pass that cannot end (the database away mid-pass, a batch failing again) extends a hold
    only up to ``HOLD_LOG_LINES_MAX_SECONDS``; once it ended there, the sweep alone does not begin it
    again, and the held files are made."""
    from smart_triggerer.supervisor import log_files

    clock = FakeClock(monkeypatch)
    supervisor = pacing_supervisor()
    hand_out(supervisor, log_files.HOLD_LOG_LINES_FROM)
    supervisor.files.pace()
    all_running(supervisor)
    held = seconds_held(supervisor, clock)
    assert (
        log_files.HOLD_LOG_LINES_MAX_SECONDS
        <= held
        <= log_files.HOLD_LOG_LINES_MAX_SECONDS + log_files.HELD_LOG_LINES_SECONDS + 1
    )
    assert_no_hold_for(supervisor, clock, 100)


def test_groups_that_never_report_running_hold_first_log_lines_no_longer_than_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A big hand-out whose groups never report running (started, not built: the database away) holds up
    to ``HOLD_LOG_LINES_MAX_SECONDS``; the same hand-out begins no new hold after it, a new arrival
    does."""
    from smart_triggerer.supervisor import log_files

    clock = FakeClock(monkeypatch)
    supervisor = pacing_supervisor()
    supervisor.hash_xmin, supervisor.sweep_after = "100", 0  # no sweep: the groups alone
    hand_out(supervisor, log_files.HOLD_LOG_LINES_FROM)
    for group in list(supervisor.groups.unstarted.values()):
        supervisor.groups.start(group)  # handed out, never reported running
    supervisor.files.pace()
    assert seconds_held(supervisor, clock) >= log_files.HOLD_LOG_LINES_MAX_SECONDS
    assert_no_hold_for(supervisor, clock, 100)  # the same hand-out: no new hold
    supervisor.groups.join(10_000, identity_hash=10_000)  # a new arrival
    supervisor.files.pace()
    assert supervisor.files.pool.holding


class Pacing:
    """The log files part, built as the supervisor builds it, beside the start's state it asks about (a
    start-up sweep's pass under way) and the coroutines the runner reports running."""

    def __init__(self) -> None:
        from smart_triggerer.supervisor.log_files import LogFiles

        self.shared = shared()
        self.groups = self.shared.groups
        self.running_triggers: set[int] = set()
        self.hash_xmin: str | None = None
        self.sweep_after = 1000
        self.to_read: set[int] = set()
        self.owned = {1, 2}
        self.files = LogFiles(
            self.shared,
            running=lambda: self.running_triggers,
            start_under_way=self.start_under_way,
            logger_cache={},
        )

    def start_under_way(self) -> bool:
        from smart_triggerer.supervisor.starting import start_under_way

        return start_under_way(self.hash_xmin, self.sweep_after, self.to_read, self.owned)


def pacing_supervisor() -> Pacing:
    return Pacing()


def hand_out(supervisor: Pacing, count: int) -> None:
    """``count`` groups read and waiting to start."""
    for member in range(count):
        supervisor.groups.join(member, identity_hash=member)


def all_running(supervisor: Pacing) -> None:
    for group in list(supervisor.groups.unstarted.values()):
        runner = supervisor.groups.start(group)
        assert runner is not None  # every group handed out has a leader
        supervisor.running_triggers.add(runner)


def seconds_held(supervisor: Pacing, clock: FakeClock) -> float:
    """A second at a time until the hold ends (twice the cap at most, then it must have ended)."""
    from smart_triggerer.supervisor import log_files

    began = clock.now
    while supervisor.files.pool.holding and clock.now - began < 2 * log_files.HOLD_LOG_LINES_MAX_SECONDS:
        clock.now += 1.0
        supervisor.files.pace()
    assert not supervisor.files.pool.holding
    return clock.now - began


def assert_no_hold_for(supervisor: Pacing, clock: FakeClock, seconds: int) -> None:
    for _ in range(seconds):
        clock.now += 1.0
        supervisor.files.pace()
        assert not supervisor.files.pool.holding


class FakeClock:
    """The clock of the supervisor's starting part and of its log pool (not the process's): moved by the
    test, and ``tick`` seconds more at every look (each file written then costs time, whatever the
    machine)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tick: float = 0.0) -> None:
        from smart_triggerer.supervisor import log_files, trigger_logs

        self.now, self.tick = 1000.0, tick
        for module in (log_files, trigger_logs):
            monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=self.look))

    def look(self) -> float:
        self.now += self.tick
        return self.now


def exiting_supervisor(tmp_path: Path, held: int, ended: int) -> Pacing:
    """A supervisor on its way out (as ``_shutdown`` leaves it) with ``held`` files whose first line is
    held (a recent takeover's) and ``ended`` ended coroutines' files, each holding a line too."""
    from smart_triggerer.supervisor.trigger_logs import PooledLogFile, PooledTriggerLoggingFactory

    supervisor = pacing_supervisor()
    supervisor.files.pool.holding = True
    for n in range(held):
        PooledLogFile(tmp_path / f"held-{n}.log", supervisor.files.pool).write(b"trigger starting\n")
    for n in range(ended):
        factory = PooledTriggerLoggingFactory(
            log_path=str(tmp_path / f"ended-{n}.log"),
            ti=None,  # type: ignore[arg-type]  # no task instance
            pool=supervisor.files.pool,
        )
        factory([lambda _l, _m, event: event["event"].encode()]).log(20, "trigger completed")  # a line each
        supervisor.files.ended[n] = factory
    assert len(supervisor.files.pool.held) == held + ended and not list(tmp_path.iterdir())
    supervisor.files.pool.exiting = True
    return supervisor


def written(tmp_path: Path, prefix: str, line: str) -> int:
    files = list(tmp_path.glob(f"{prefix}-*.log"))
    assert all(path.read_text() == line for path in files)
    return len(files)


def test_at_exit_a_takeovers_held_log_lines_are_written_not_dropped_after_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling restart stops the instance that took thousands over while their first lines are still
    held (made in the background at a quarter of a core): the exit writes them within its budget, at a
    cost per file that took the whole second an exit used to get."""
    from structlog.testing import capture_logs

    FakeClock(monkeypatch, tick=0.005)  # 300 files, three looks or so each: about 5 s of writing
    supervisor = exiting_supervisor(tmp_path, held=200, ended=100)
    with capture_logs() as logs:
        supervisor.files.write_at_exit(20.0)
    assert written(tmp_path, "held", "trigger starting\n") == 200
    assert written(tmp_path, "ended", "trigger completed\n") == 100
    assert not supervisor.files.ended and not supervisor.files.pool.held
    assert [line["event"] for line in logs if line["log_level"] == "warning"] == []


def test_at_exit_a_slow_remote_log_store_costs_no_local_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ended coroutines' files are closed, then uploaded off the loop (remote logging): a remote that
    takes seconds a file costs neither a held line nor a closed file; the exit says what it did not
    upload, in one line."""
    import threading

    from airflow.sdk import log as sdk_log
    from structlog.testing import capture_logs

    release = threading.Event()

    class SlowRemote:
        def upload(self, path: str, ti: object = None) -> None:
            release.wait(30)  # the store answers only once the test is over

    monkeypatch.setattr(sdk_log, "load_remote_log_handler", SlowRemote)
    FakeClock(monkeypatch, tick=0.0)
    supervisor = exiting_supervisor(tmp_path, held=50, ended=20)
    with capture_logs() as logs:
        supervisor.files.write_at_exit(10.0)
        supervisor.files.uploads.finish(0.2)
    release.set()
    assert written(tmp_path, "held", "trigger starting\n") == 50
    assert written(tmp_path, "ended", "trigger completed\n") == 20
    said = {line["event"]: line for line in logs}
    assert "ended triggers' log files not closed at exit" not in said
    assert "trigger log lines not written at exit" not in said
    left = said["trigger log files not uploaded to the remote store at exit (their local files are kept)"]
    assert left["left"] == 20 and left["uploaded"] == 0


def test_at_exit_what_the_budget_leaves_unwritten_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs

    from smart_triggerer.supervisor import log_files

    monkeypatch.setattr(log_files, "EXIT_SAY_FILES_FROM", 10)
    FakeClock(monkeypatch, tick=0.1)  # three looks or so a file: a few files fit in 2 s
    supervisor = exiting_supervisor(tmp_path, held=50, ended=0)
    with capture_logs() as logs:
        supervisor.files.write_at_exit(2.0)
    done = written(tmp_path, "held", "trigger starting\n")
    assert 0 < done < 50
    said = {line["event"]: line for line in logs}
    assert said["writing trigger log files before exit"]["held"] == 50
    assert said["trigger log lines not written at exit"]["files"] == 50 - done


def test_at_exit_a_disk_that_refuses_files_ends_the_writing_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk or a read-only mount refuses every file alike: after ``EXIT_REFUSED_AT_MOST`` refused
    writes the rest are given up on, ended files included (one warning for each refused file, one for
    the rest), not tried for the whole budget. A file that was refused already while the instance ran
    (warned about then) counts too."""
    from structlog.testing import capture_logs

    from smart_triggerer.supervisor import log_files
    from smart_triggerer.supervisor.trigger_logs import PooledLogFile, PooledTriggerLoggingFactory

    monkeypatch.setattr(log_files, "EXIT_REFUSED_AT_MOST", 5)
    FakeClock(monkeypatch, tick=0.0)  # time never runs out: only the refusals stop it
    supervisor = pacing_supervisor()
    blocked = tmp_path / "logs"
    blocked.write_text("a file where the log folder should be")
    earlier = [PooledLogFile(blocked / "dag_id=d" / f"e{n}.log", supervisor.files.pool) for n in range(3)]
    for log_file in earlier:  # refused while the instance ran: warned about then
        log_file.write(b"trigger starting\n")
    supervisor.files.pool.holding = True
    for log_file in earlier:  # and lines held for them again since
        log_file.write(b"trigger fired\n")
    for n in range(30):
        PooledLogFile(blocked / "dag_id=d" / f"t{n}.log", supervisor.files.pool).write(b"trigger starting\n")
    for n in range(10):
        factory = PooledTriggerLoggingFactory(
            log_path=str(blocked / "dag_id=d" / f"ended-{n}.log"),
            ti=None,  # type: ignore[arg-type]  # no task instance
            pool=supervisor.files.pool,
        )
        factory([lambda _l, _m, event: event["event"].encode()]).log(20, "trigger completed")
        supervisor.files.ended[n] = factory
    supervisor.files.pool.exiting = True
    with capture_logs() as logs:
        supervisor.files.write_at_exit(60.0)
    refused = [line for line in logs if line["event"].startswith("cannot write a trigger log file")]
    assert len(refused) == 2  # the three refused before warn no more: 5 refusals, 2 of them new files
    said = {line["event"]: line for line in logs}
    left = said["trigger log lines not written at exit"]
    assert (left["log_level"], left["files"], left["refused_writes"]) == ("warning", 43 - 5, 5)
    assert said["ended triggers' log files not closed at exit"]["files"] == 10
