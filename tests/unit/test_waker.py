"""A stop ends the supervisor's wait in ``select`` at once (smart_triggerer/waker.py): the leases
are released then, not when the runner's next message comes."""

from __future__ import annotations

import selectors
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from smart_triggerer.waker import Waker


@pytest.fixture
def waker() -> Iterator[Waker]:
    made = Waker()
    yield made
    made.close()


def _serve(selector: selectors.BaseSelector, timeout: float) -> list[object]:
    """One select as Airflow's supervisor loop makes it: each ready handler is called."""
    ready: list[object] = []
    for key, _ in selector.select(timeout):
        handler, _on_close = key.data
        assert handler(key.fileobj)
        ready.append(key.fileobj)
    return ready


def test_a_signal_ends_a_long_wait_in_select(waker: Waker) -> None:
    selector = selectors.DefaultSelector()
    waker.attach(selector)
    waker.attach(selector)  # once only
    previous = signal.signal(signal.SIGALRM, lambda *_: waker.wake())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        ready = _serve(selector, 60.0)  # Python retries an interrupted select: without the waker, 60 s
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert ready == [waker.reader]
    assert _serve(selector, 0.0) == []  # drained: the next wait is a wait again
    selector.close()


def test_wakes_without_a_reader_never_block_nor_raise(waker: Waker) -> None:
    done = threading.Event()

    def flood() -> None:
        for _ in range(200_000):  # past what the socket holds: the rest are dropped
            waker.wake()
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(60)
    waker.close()
    waker.wake()  # after close too (a signal during the exit)


def test_a_stop_signal_wakes_the_smart_supervisor() -> None:
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor
    from smart_triggerer.supervisor.service import SmartTriggererJobRunner

    supervisor = object.__new__(SmartTriggerRunnerSupervisor)
    supervisor.stop = False
    supervisor.waker = Waker()
    job_runner = object.__new__(SmartTriggererJobRunner)
    job_runner.trigger_runner = supervisor
    try:
        before = time.monotonic()
        job_runner._exit_gracefully(signal.SIGTERM, None)
        assert supervisor.stop is True
        assert supervisor.waker.reader.recv(16) == b"\0"  # the wait in select ends now
        signalled_at = job_runner.signalled_at  # the exit's log files are written until a time after it
        assert signalled_at is not None and before <= signalled_at <= time.monotonic()
    finally:
        supervisor.waker.close()


def test_threads_of_ours_leave_stop_signals_to_the_main_thread() -> None:
    """The kernel gives a process's SIGTERM to a thread that does not block it: the main one, whose
    select it then interrupts."""
    from smart_triggerer.waker import STOP_SIGNALS, leave_stop_signals_to_the_main_thread

    masks: dict[str, set[int]] = {}

    def thread_of_ours() -> None:
        leave_stop_signals_to_the_main_thread()
        masks["ours"] = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        child = threading.Thread(
            target=lambda: masks.update(child=set(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        )
        child.start()
        child.join()

    worker = threading.Thread(target=thread_of_ours)
    worker.start()
    worker.join()
    assert masks["ours"] >= STOP_SIGNALS and masks["child"] >= STOP_SIGNALS  # its threads inherit it
    assert not STOP_SIGNALS & set(signal.pthread_sigmask(signal.SIG_BLOCK, []))  # the main thread's: open


def test_a_closed_waker_is_never_watched_again(waker: Waker) -> None:
    selector = selectors.DefaultSelector()
    waker.attach(selector)
    waker.close()
    waker.attach(selector)  # the next loop's attach: nothing to watch
    assert selector.get_map() is not None and len(selector.get_map()) == 0
    selector.close()
