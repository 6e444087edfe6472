"""Trigger log files with a bounded number of open descriptors.

Airflow's supervisor writes each trigger's log lines to the task's trigger log file and keeps that file
open from the trigger's first line ("trigger ... starting") until it ends: one descriptor per running
coroutine. Past the process's ``RLIMIT_NOFILE`` every open fails, and the supervisor dies with
"Too many open files" (the stock triggerer does once its triggers outnumber the limit; a common soft
limit is 1,024). A smart instance that takes over a dead peer's shards runs all their groups, so its
count of coroutines is not bounded by its share.

Here a trigger's file is opened when a line is written and stays open while it is among the most
recently written ones; the least recently written is closed when the pool is full and opened again
(appending) for its next line. While waiting, most triggers write nothing, so reopening is rare; a
trigger that logs every poll, with more of them than the pool holds, pays an open and a close per line.

While a takeover or a start hands out thousands of coroutines, the pool *holds* the lines of files not
made yet (each coroutine's "trigger ... starting") in memory, and the supervisor makes those files after
every coroutine polls, a time budget per loop (``write_held``). Making a file (and its task's folder, on a
host where the task never ran) costs kernel time, and made with each first line, tens of thousands of
files took the supervisor's CPU while its coroutines waited to start. A line is held as it came from the
runner, before Airflow's processors (secrets masking, rendering: a cost of their own) run on it; they
run when its file is made. The runner stamps each line with its time, so a held line keeps it. A file
not made yet goes on holding its lines after the hold, and so does a file made but not open while files
wait to be made: both are written sooner than the others, still within the budget. Making (or opening
again) thousands at once in the log path, when thousands of coroutines logged together (a handover
cancelling them, each with its "trigger completed"), stopped the supervisor's loop on a slow disk, past
its leases (measured: docs/design.md, Measurements behind the code). A file that is closed, is uploaded
or is asked for its descriptor is written at once, held lines first.
"""

from __future__ import annotations

import math
import os
import resource
import select
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import attrs
import structlog
from airflow.jobs.triggerer_job_runner import TriggerLoggingFactory

from smart_triggerer.db.errors import cause
from smart_triggerer.supervisor.log_uploads import LogUploads, Upload

# at most this many trigger log files open at once, and never more than a quarter of the descriptors the
# process may open (the rest: database connections, the runner's sockets, the health server)
MAX_OPEN_LOG_FILES = 256

# reopening closed files from the log path: at most this long per window, then their lines wait for the
# budgeted writer (a handover's thousands of last lines, each a reopen, stopped the loop for seconds)
REOPEN_SECONDS = 0.02
REOPEN_WINDOW_SECONDS = 0.2
# past this many files waiting, lines of made files are written at once again: the writer is not keeping
# up (more closed files logging than its budget reopens), and memory must not grow without end
MAX_WAITING_FILES = 10_000
# and past this many bytes held (every file's together), too: a takeover's first lines are a few hundred
# bytes each, but a trigger that logs a lot while its file waits must not grow the supervisor for ever
MAX_HELD_BYTES = 64 * 2**20
HELD_CALL_BYTES = 512  # a held logger call, counted as a line of about this size (rendered only later)

log = structlog.get_logger(logger_name=__name__)

# reads of Airflow's 4 KB each in one pass of the supervisor's loop, while the runner's log channel has data
# (256 KB: the runner's biggest batch of lines, runner.py)
LOG_READS_PER_PASS = 64


def open_files_allowed() -> int:
    """How many trigger log files may be open at once in this process."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_LOG_FILES
    return max(1, min(MAX_OPEN_LOG_FILES, soft // 4))


class FileSettings(NamedTuple):
    """Airflow's base log folder and the permission bits of new log files and folders."""

    base_folder: str
    file_mode: int
    folder_mode: int


class LogFilePool:
    """The open handles of pooled log files, least recently written first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: OrderedDict[PooledLogFile, BinaryIO] = OrderedDict()
        self._settings: FileSettings | None = None
        # files whose lines are held (not made yet, or not open while others wait), in the order their first
        # held line came; those that got a line after the hold are written first
        self.held: dict[PooledLogFile, None] = {}
        self.sooner: dict[PooledLogFile, None] = {}
        self.holding = False
        self.exiting = False  # on the way out: every line is written at once (nothing would write it later)
        self._reopen_window = (-float("inf"), 0.0)  # (start, seconds spent reopening in it)
        self.new_file_held_at = -float("inf")  # when a file not made yet last got its first held line
        self.refused_writes = 0  # writes the file system refused (OSError), every one (a file warns once)
        self.held_bytes = 0  # of every held line and call (``HELD_CALL_BYTES`` each)

    def write_held(self, budget_seconds: float, *, refused_at_most: int | None = None) -> bool:
        """Make held files and write their lines, oldest first, for up to ``budget_seconds`` and, with
        ``refused_at_most``, until the file system refused that many more writes (a full disk, a
        read-only mount: the rest would fail alike); True when some are left."""
        deadline = time.monotonic() + budget_seconds
        stop_at = math.inf if refused_at_most is None else self.refused_writes + refused_at_most
        turn = 0
        while self.held and time.monotonic() < deadline and self.refused_writes < stop_at:
            # files with news and the oldest in turn: news never starve a file holding only its first line
            log_file = next(iter(self.sooner if self.sooner and turn % 2 == 0 else self.held))
            turn += 1
            if not log_file.has_held():  # nothing left in it (a write that failed half way)
                self.forget_held(log_file)
                continue
            log_file.write_held()
        return bool(self.held)

    def forget_held(self, log_file: PooledLogFile) -> None:
        self.held.pop(log_file, None)
        self.sooner.pop(log_file, None)

    def should_wait(self, log_file: PooledLogFile) -> bool:
        """A line for a made file that is not open waits for the writer: while files wait to be made (a
        takeover's), or once this window's reopening time is spent. Never on the way out, nor while more
        files wait than ``MAX_WAITING_FILES``."""
        if self.exiting or self.is_open(log_file) or len(self.held) >= MAX_WAITING_FILES:
            return False
        if self.held:
            return True
        start, spent = self._reopen_window
        return time.monotonic() - start < REOPEN_WINDOW_SECONDS and spent >= REOPEN_SECONDS

    def _reopened(self, seconds: float) -> None:
        now = time.monotonic()
        start, spent = self._reopen_window
        within = now - start < REOPEN_WINDOW_SECONDS
        self._reopen_window = (start, spent + seconds) if within else (now, seconds)

    def file_settings(self) -> FileSettings:
        """Read from Airflow's config once."""
        if self._settings is None:
            from airflow.sdk.configuration import conf

            files = conf.get("logging", "file_task_handler_new_file_permissions", fallback="0o664")
            folders = conf.get("logging", "file_task_handler_new_folder_permissions", fallback="0o775")
            self._settings = FileSettings(
                conf.get("logging", "base_log_folder"), int(files, 8), int(folders, 8)
            )
        return self._settings

    def __len__(self) -> int:
        return len(self._open)

    def is_open(self, log_file: PooledLogFile) -> bool:
        return log_file in self._open

    def handle(self, log_file: PooledLogFile) -> BinaryIO:
        """The file's open handle, opening it (and closing the least recently written) when needed."""
        handle = self._open.get(log_file)
        if handle is not None:
            self._open.move_to_end(log_file)
            return handle
        began = time.monotonic()
        handle = log_file.open_handle()  # first: a file that cannot open closes no other
        self._reopened(time.monotonic() - began)
        while len(self._open) >= self.limit:
            oldest, evicted = self._open.popitem(last=False)
            try:
                evicted.close()
            except OSError as err:  # its buffered line could not be flushed: its own loss, not the new file's
                log.warning(
                    "cannot close a trigger log file; its last lines are dropped",
                    path=oldest.name,
                    error=str(err),
                )
        self._open[log_file] = handle
        return handle

    def flush(self, log_file: PooledLogFile) -> None:
        handle = self._open.get(log_file)
        if handle is not None:
            handle.flush()

    def release(self, log_file: PooledLogFile) -> None:
        handle = self._open.pop(log_file, None)
        if handle is not None:
            handle.close()


class PooledLogFile:
    """A binary file for structlog's ``BytesLogger`` whose descriptor lives in a ``LogFilePool``.

    The first open creates or truncates it, with Airflow's permissions for new log files, as Airflow's own
    trigger log file is; reopening appends. Its folder is made (as Airflow makes it) only when missing: a
    task's folder usually exists (its worker logged there before it deferred), and Airflow's way, a folder
    check and a ``touch`` before every first open, costs system calls for each of a takeover's thousands
    of new coroutines (docs/design.md, Measurements behind the code).
    """

    def __init__(self, path: str | os.PathLike[str], pool: LogFilePool) -> None:
        self.name = os.fspath(path)
        self.closed = False
        self._pool = pool
        self._opened = False
        self._warned = False
        # lines (bytes) and logger calls not processed yet, in the order they came, while the file is held
        self._held: list[bytes | Callable[[], Any]] = []
        self._held_bytes = 0
        self._rendering: list[bytes] | None = None  # where lines go while held calls are processed

    def open_handle(self) -> BinaryIO:
        if self.closed:
            raise ValueError(f"I/O operation on closed log file {self.name}")
        try:
            handle = self._open()
        except FileNotFoundError:
            # its folder is missing (never made here: the worker ran elsewhere, or log retention removed it
            # while the trigger waited): made as Airflow's ``init_log_folder`` makes it (the configured mode
            # on the last folder), without its ``init_log_file`` reading three settings and touching the
            # file first (work repeated for each held file after a takeover; measured: docs/design.md)
            folder_mode = self._pool.file_settings().folder_mode
            os.makedirs(os.path.dirname(self.name), mode=folder_mode, exist_ok=True)
            handle = self._open()
        self._opened = True
        return handle

    def _open(self) -> BinaryIO:
        how = os.O_APPEND if self._opened else os.O_TRUNC
        descriptor = os.open(self.name, os.O_WRONLY | os.O_CREAT | how, self._pool.file_settings().file_mode)
        return os.fdopen(descriptor, "ab" if self._opened else "wb")

    def write(self, data: bytes) -> int:
        """Write a line; one that cannot be written is dropped with a warning (the stock triggerer, whose
        file stays open, goes on writing to a removed file): a log file never stops the supervisor."""
        if self.closed:
            raise ValueError(f"I/O operation on closed log file {self.name}")
        if self._rendering is not None:
            self._rendering.append(data)
            return len(data)
        if self.holds():
            self.hold(data)
            return len(data)
        try:
            return self._handle().write(data)
        except OSError as err:
            self._dropped(err)
            return 0

    def holds(self) -> bool:
        """Lines for this file are held now: it is not made yet, and the pool holds or lines of it are
        held already; or it is made but not open and the pool says its line should wait
        (``should_wait``: a handover's or a burst's lines, a reopen each, would otherwise stop the loop
        as making them did). The pool's budgeted ``write_held`` writes them, files with news in turn
        with the oldest."""
        if self.closed or self._pool.exiting or self._pool.held_bytes >= MAX_HELD_BYTES:
            return False  # the write below writes what this file holds first, in order
        if self._opened:
            return bool(self._held) or self._pool.should_wait(self)
        return bool(self._held) or self._pool.holding

    def has_held(self) -> bool:
        return bool(self._held)

    def hold(self, item: bytes | Callable[[], Any]) -> None:
        """Keep a line, or a logger call whose processing and line wait, until the file is made (or
        opened again)."""
        if not self._held and not self._opened:
            self._pool.new_file_held_at = time.monotonic()
        self._held.append(item)
        size = len(item) if isinstance(item, bytes) else HELD_CALL_BYTES
        self._held_bytes += size
        self._pool.held_bytes += size
        self._pool.held[self] = None
        if self._opened or not self._pool.holding:  # news after the hold: written before the others
            self._pool.sooner[self] = None

    def write_held(self) -> None:
        """Make the file and write the lines held for it; lines that cannot be written are dropped, so a
        file never stays held (``write_held`` of the pool would meet it again every loop)."""
        try:
            self._handle().flush()
        except (OSError, ValueError) as err:
            self._dropped(err)

    def _handle(self) -> BinaryIO:
        """The open handle, the held lines written first (they were held only because it was not made)."""
        handle = self._pool.handle(self)
        if self._held:
            try:
                held = self._render_held()
            finally:
                self._pool.forget_held(self)
            handle.write(held)
        return handle

    def _render_held(self) -> bytes:
        """The held lines, held logger calls processed now (their lines come back through ``write``)."""
        held = self._take_held()
        lines: list[bytes] = []
        self._rendering = lines
        try:
            for item in held:
                if isinstance(item, bytes):
                    lines.append(item)
                    continue
                try:
                    item()
                except Exception as err:  # a line that cannot be processed is lost alone
                    self._dropped(err)
        finally:
            self._rendering = None
        return b"".join(lines)

    def _take_held(self) -> list[bytes | Callable[[], Any]]:
        held, self._held = self._held, []
        self._pool.held_bytes -= self._held_bytes
        self._held_bytes = 0
        return held

    def _dropped(self, err: Exception) -> None:
        self._take_held()
        self._pool.forget_held(self)
        if isinstance(err, OSError):  # the file system refused it (a processor's error is the line's own)
            self._pool.refused_writes += 1
        if not self._warned:
            log.warning(
                "cannot write a trigger log file; its lines are dropped", path=self.name, error=str(err)
            )
            self._warned = True

    def flush(self) -> None:
        self._pool.flush(self)

    def fileno(self) -> int:
        # Airflow's remote log upload asks for it (to skip stdout); a real descriptor, as a file would give
        return self._handle().fileno()

    def close(self) -> None:
        if self._held:  # the coroutine ended before its file was made: its lines are written now
            self.write_held()
        self._pool.release(self)
        self.closed = True


class _HoldingLogger:
    """The trigger's logger as Airflow's supervisor uses it (``log(level, event, **kw)`` per runner line):
    while its file is held, a call is kept unprocessed; otherwise, and for anything else, the logger. The
    logger itself is made at its first use, not with the first line: while a takeover's first lines are
    held, making structlog's logger for each new coroutine (its ``BytesLogger`` and ``bind``) took the
    supervisor's CPU while the runner still created them (docs/design.md, Measurements behind the code).
    It refers to nothing of its factory's: a factory whose coroutine ended is freed at once, not left to
    the collector."""

    def __init__(self, log_file: PooledLogFile, processors: Iterable[Any]) -> None:
        self._file = log_file
        self._processors = processors
        self.made: Any = None  # structlog's logger, once made

    @property
    def _logger(self) -> Any:
        if self.made is None:
            self.made = structlog.wrap_logger(
                structlog.BytesLogger(self._file),  # type: ignore[arg-type]
                processors=self._processors,
            ).bind()
        return self.made

    def log(self, level: int, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._file.holds():
            self._file.hold(partial(self._log_held, level, event, args, kw))
            return None
        self._release()
        return self._logger.log(level, event, *args, **kw)

    def _log_held(self, level: int, event: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        # the logger is looked up when the held call is processed: it is made only then
        return self._logger.log(level, event, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        self._release()
        return getattr(self._logger, name)

    def _release(self) -> None:
        """Held calls are processed before any new one, and never from inside the logger: structlog's
        ``BytesLogger`` writes under a lock that a held call processed from its write would wait on."""
        if self._file.has_held():
            self._file.write_held()


@attrs.define(kw_only=True)
class PooledTriggerLoggingFactory(TriggerLoggingFactory):
    """Airflow's per-trigger log factory, writing through a ``LogFilePool``."""

    pool: LogFilePool
    _holding_logger: _HoldingLogger = attrs.field(init=False, repr=False)

    def __call__(self, processors: Iterable[Any]) -> Any:
        holding = getattr(self, "_holding_logger", None)
        if holding is not None:
            return holding
        base_folder = self.pool.file_settings().base_folder
        # where Airflow's init_log_file places it; a plain string: a Path would be parsed for each new
        # coroutine's first line (measured: docs/design.md)
        path = os.path.join(base_folder, self.log_path)
        log_file = PooledLogFile(path, self.pool)
        self._filehandle = log_file  # type: ignore[assignment]
        self._holding_logger = _HoldingLogger(log_file, processors)
        return self._holding_logger

    def upload_to_remote(self) -> None:
        self.write_for_upload()
        super().upload_to_remote()

    def write_for_upload(self) -> bool:
        """The upload reads the file: lines still held go to it first. False: the coroutine logged nothing
        (a handover right after its start) and has no file, so Airflow's upload does nothing."""
        log_file = getattr(self, "_filehandle", None)
        if isinstance(log_file, PooledLogFile) and log_file.has_held():
            log_file.write_held()
        holding = getattr(self, "_holding_logger", None)
        if holding is None or holding.made is None:
            return False
        self.bound_logger = holding.made  # Airflow's upload reads the file's path from it
        return True

    @classmethod
    def replacing(cls, factory: TriggerLoggingFactory, pool: LogFilePool) -> PooledTriggerLoggingFactory:
        """The pooled twin of a factory Airflow made (before it wrote anything)."""
        assert not hasattr(factory, "bound_logger"), "a factory that wrote already keeps its own file"
        return cls(log_path=factory.log_path, ti=factory.ti, pool=pool)


def remote_upload(factory: TriggerLoggingFactory) -> Upload | None:
    """What Airflow's ``upload_to_remote`` sends for an ended coroutine's file, taken while the file is
    still open (its lines written), to be sent off the loop once it is closed (``log_uploads.py``). None
    without remote logging, or when the coroutine wrote no file."""
    from airflow.sdk.log import load_remote_log_handler

    handler = load_remote_log_handler()
    if handler is None:
        return None
    if isinstance(factory, PooledTriggerLoggingFactory):
        if not factory.write_for_upload():
            return None
    elif not hasattr(factory, "bound_logger"):
        return None  # never called: no file (as in Airflow's)
    # the path relative to base_log_folder, as Airflow's upload computes it from the open file
    return Upload(handler, Path(factory.log_path).as_posix(), factory.ti)


def close_ended(trigger_id: int, factory: TriggerLoggingFactory, uploads: LogUploads) -> None:
    """Close an ended coroutine's file, then queue its upload (where remote logging is set). Neither a
    file that cannot be closed (a full disk, a stale network mount) nor a remote store stops the loop."""
    upload = None
    try:
        upload = remote_upload(factory)
    except Exception:
        log.exception("Failed to upload trigger logs to remote", trigger_id=trigger_id)
    try:
        factory.close()
    except Exception as err:  # as in Airflow's loop, which caught it in its request handling
        log.warning("could not close a trigger's log file", trigger_id=trigger_id, error=cause(err))
    if upload is not None:
        uploads.submit(upload)


def read_while_ready(read: Any, sock: Any, reads: int) -> bool:
    """Call ``read`` (Airflow's log reader: one blocking ``recv`` of 4 KB) while ``sock`` has data now, up
    to ``reads`` times; False once the channel closed (the reader said so)."""
    for _ in range(reads):
        ready, _, _ = select.select([sock], [], [], 0)
        if not ready:
            return True  # keep the socket: nothing (more) to read now
        if not read(sock):
            return False
    return True


def reading_only_ready(read: Any) -> Any:
    """``read`` as the supervisor's loop calls it for the runner's log channel: only while the socket has
    data now (the loop's select may be stale: a runner request handled since may have read the channel
    through), and again while it still has, up to ``LOG_READS_PER_PASS`` reads. Airflow reads 4 KB per pass
    of its loop: at the end of a takeover the runner's first lines took a pass of the whole loop per 4 KB,
    each with its lease checks, metrics and a ``waitpid``, on the cores the runner was starting them on
    (docs/design.md, Measurements behind the code). ``raw`` is Airflow's reader, for reads that count
    its 4 KB reads themselves (and tells a wrapped reader)."""

    def reading(sock: Any) -> bool:
        return read_while_ready(read, sock, LOG_READS_PER_PASS)

    reading.raw = read  # type: ignore[attr-defined]
    return reading
