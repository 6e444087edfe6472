"""Remote log uploads off the supervisor's loop.

Airflow uploads an ended trigger's log file (``[logging] remote_logging``: S3, GCS, Elasticsearch...) in
the supervisor's loop, as it handles the runner's message. One slow or hanging remote store then stalls
the loop past the lease, and every shard lapses and moves. Here the loop only queues the upload (the
file is complete and closed by then) and a worker thread sends it. The queue is bounded
(``QUEUED_AT_MOST``: past it a file is kept locally only, counted and said once a minute), an upload
that takes longer than ``UPLOAD_TIMEOUT_SECONDS`` is given up (a thread blocked in a call cannot be
stopped: it is left to finish or not, and a new worker takes the queue, ``STUCK_AT_MOST`` of them at most),
and what is still queued at exit is said in one line. The local file stays where Airflow writes it in
every case, so the log can still be read from the instance (``serve-logs``) or shipped by other means.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(logger_name=__name__)

QUEUED_AT_MOST = 10_000
UPLOAD_TIMEOUT_SECONDS = 60.0
STUCK_AT_MOST = 4  # workers left in a hung call before uploads stop until one returns
SAY_EVERY_SECONDS = 60.0


@dataclass
class Upload:
    handler: Any  # Airflow's RemoteLogIO
    relative_path: str
    ti: Any


@dataclass
class _Worker:
    thread: threading.Thread | None = None
    busy_since: float | None = None  # time.monotonic() the current upload began
    current: str | None = None
    abandoned: bool = False


class LogUploads:
    """A bounded queue of uploads and the worker thread that sends them, one at a time (a remote handler
    need not be safe to call from several threads)."""

    def __init__(
        self,
        timeout: float = UPLOAD_TIMEOUT_SECONDS,
        queued_at_most: int = QUEUED_AT_MOST,
        stuck_at_most: int = STUCK_AT_MOST,
    ) -> None:
        self.timeout, self.queued_at_most, self.stuck_at_most = timeout, queued_at_most, stuck_at_most
        self.queue: deque[Upload] = deque()
        self.ready = threading.Condition()
        self.worker: _Worker | None = None
        self.stuck: list[_Worker] = []
        self.uploaded = self.failed = self.timed_out = self.skipped = 0
        self.said_at = -float("inf")
        self.closing = False

    def submit(self, upload: Upload) -> None:
        """From the supervisor's loop: never waits for the remote store."""
        self._check_worker()
        with self.ready:
            if len(self.queue) >= self.queued_at_most or self._too_many_stuck():
                self.skipped += 1
                self._say_skipped()
                return
            self.queue.append(upload)
            self.ready.notify()
        if self.worker is None:
            self._start_worker()

    def check(self) -> None:
        """From the supervisor's loop, once per pass: give up an upload past its timeout."""
        self._check_worker()

    def pending(self) -> int:
        with self.ready:
            return len(self.queue) + (1 if self.worker is not None and self.worker.busy_since else 0)

    def finish(self, budget_seconds: float) -> None:
        """At exit: the queued uploads for up to ``budget_seconds``; what is left said in one line."""
        deadline = time.monotonic() + budget_seconds
        while self.pending() and time.monotonic() < deadline:
            self._check_worker()
            time.sleep(0.05)
        with self.ready:
            self.closing = True
            left = len(self.queue) + (1 if self.worker is not None and self.worker.busy_since else 0)
            self.queue.clear()
            self.ready.notify_all()
        if left or self.skipped or self.timed_out:
            log.warning(
                "trigger log files not uploaded to the remote store at exit (their local files are kept)",
                left=left,
                given_up_after_timeout=self.timed_out,
                skipped=self.skipped,
                failed=self.failed,
                uploaded=self.uploaded,
            )

    def _too_many_stuck(self) -> bool:
        self.stuck = [w for w in self.stuck if w.thread is not None and w.thread.is_alive()]
        return len(self.stuck) >= self.stuck_at_most

    def _check_worker(self) -> None:
        worker = self.worker
        if worker is None or worker.busy_since is None:
            return
        if time.monotonic() - worker.busy_since <= self.timeout:
            return
        with self.ready:
            if worker.busy_since is None:  # it returned meanwhile
                return
            worker.abandoned = True
            self.timed_out += 1
            self.stuck.append(worker)
            self.worker = None
        log.warning(
            "a remote log upload did not finish in time; given up (the local file is kept)",
            path=worker.current,
            timeout_seconds=self.timeout,
        )
        if self.queue and not self._too_many_stuck():
            self._start_worker()

    def _start_worker(self) -> None:
        worker = _Worker()
        worker.thread = threading.Thread(target=self._work, args=(worker,), name="log-upload", daemon=True)
        self.worker = worker
        worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closing and not worker.abandoned:
                    self.ready.wait(1.0)
                if self.closing or worker.abandoned or not self.queue:
                    return
                upload = self.queue.popleft()
                worker.busy_since, worker.current = time.monotonic(), upload.relative_path
            ok = self._send(upload)
            with self.ready:
                worker.busy_since, worker.current = None, None
                if worker.abandoned:
                    return  # a replacement took the queue; this upload's outcome was counted as a timeout
                if ok:
                    self.uploaded += 1
                else:
                    self.failed += 1

    def _send(self, upload: Upload) -> bool:
        try:
            upload.handler.upload(upload.relative_path, upload.ti)
        except Exception:
            log.exception("Failed to upload trigger logs to remote", path=upload.relative_path)
            return False
        return True

    def _say_skipped(self) -> None:
        now = time.monotonic()
        if now - self.said_at >= SAY_EVERY_SECONDS:
            self.said_at = now
            log.warning(
                "remote log uploads are backed up; files kept locally only",
                skipped=self.skipped,
                queued=len(self.queue),
                stuck_uploads=len(self.stuck),
            )
