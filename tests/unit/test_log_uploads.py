"""Remote log uploads off the supervisor's loop (``smart_triggerer/supervisor/log_uploads.py``), with a store
that hangs."""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from smart_triggerer.supervisor.log_uploads import LogUploads, Upload
from tests.helpers.waiting import wait_for


class Store:
    """Uploads block while ``hang`` is set (a store that accepts and never answers)."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.released = threading.Event()
        self.sent: list[str] = []

    def upload(self, path: str, ti: Any = None) -> None:
        if self.hang.is_set():
            self.released.wait(30)
            return
        self.sent.append(path)


def test_a_hanging_store_never_holds_the_caller_and_is_given_up_per_file() -> None:
    store = Store()
    uploads = LogUploads(timeout=0.3, stuck_at_most=2)
    store.hang.set()
    started = time.monotonic()
    for n in range(50):
        uploads.submit(Upload(store, f"hung/{n}.log", None))
    assert time.monotonic() - started < 0.5, "submitting waited for the store"
    store.hang.clear()  # the first upload is stuck in its call; the others go once it is given up
    wait_for(lambda: (uploads.check(), len(store.sent))[1], lambda n: n == 49, 10, "the rest uploaded")  # type: ignore[func-returns-value]
    assert uploads.timed_out == 1 and store.sent[0] == "hung/1.log"
    store.released.set()


def test_uploads_stop_while_too_many_are_stuck_and_the_exit_says_what_is_left() -> None:
    store = Store()
    uploads = LogUploads(timeout=0.2, stuck_at_most=2)
    store.hang.set()
    for n in range(5):
        uploads.submit(Upload(store, f"hung/{n}.log", None))
    wait_for(lambda: (uploads.check(), uploads.timed_out)[1], lambda n: n == 2, 10, "two given up")  # type: ignore[func-returns-value]
    uploads.submit(Upload(store, "late.log", None))
    assert uploads.skipped == 1, "no new worker while two are stuck: the file is kept locally only"
    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        uploads.finish(0.3)
    assert time.monotonic() - started < 1.0
    said = [e for e in logs if "not uploaded" in e["event"]]
    assert len(said) == 1 and said[0]["left"] == 3 and said[0]["given_up_after_timeout"] == 2, logs
    store.released.set()


def test_a_failing_upload_is_counted_and_the_next_goes() -> None:
    class Failing:
        def __init__(self) -> None:
            self.calls = 0

        def upload(self, path: str, ti: Any = None) -> None:
            self.calls += 1
            if self.calls == 1:
                raise OSError("store refused")

    store = Failing()
    uploads = LogUploads(timeout=5)
    uploads.submit(Upload(store, "a.log", None))
    uploads.submit(Upload(store, "b.log", None))
    wait_for(lambda: uploads.uploaded + uploads.failed, lambda n: n == 2, 10, "both handled")
    assert (uploads.uploaded, uploads.failed) == (1, 1)
