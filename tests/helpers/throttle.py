"""A CPU quota for one process from outside: what a cgroup's ``cpu.max`` does to a process over its quota
(stopped most of every period), without a cgroup (which a test host may not delegate)."""

from __future__ import annotations

import contextlib
import signal
import threading

import psutil


class RunnerThrottle:
    """Stop ``process`` for ``stopped`` of every ``period`` seconds, until ``stop()``."""

    def __init__(self, process: psutil.Process, stopped: float, period: float) -> None:
        self.process, self.stopped, self.period = process, stopped, period
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"throttle {process.pid}")

    def __enter__(self) -> RunnerThrottle:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(psutil.Error):  # the process ended (killed by another fault): done
            while not self.done.is_set():
                self.process.send_signal(signal.SIGSTOP)
                self.done.wait(self.stopped)
                self.process.send_signal(signal.SIGCONT)
                self.done.wait(self.period - self.stopped)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)
        with contextlib.suppress(psutil.Error):
            self.process.send_signal(signal.SIGCONT)
