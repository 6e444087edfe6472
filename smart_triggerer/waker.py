"""Ending the supervisor's wait at once when it is asked to stop.

Airflow's supervisor waits in ``select`` for its runner's messages; a SIGTERM only sets a flag, and Python
retries an interrupted ``select`` with what is left of its timeout (PEP 475). So a stopping instance
released its leases when the runner's next message came, up to half a second later (``IDLE_TICK``), and
its shards were taken that much later. The signal handler writes a byte to a socket the ``select`` watches
instead: the loop ends, and the leases are released, at once.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import socket

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def leave_stop_signals_to_the_main_thread() -> None:
    """First thing in a thread of ours: the kernel hands a process's signal to any thread that does not
    block it, and only one that reaches the main thread interrupts its ``select`` at once (Python runs
    the handler in the main thread either way, but only once that thread runs again). Threads this
    thread starts inherit the mask."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # a platform without per-thread masks
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


class Waker:
    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self.selector: selectors.BaseSelector | None = None

    def attach(self, selector: selectors.BaseSelector) -> None:
        """Watched by ``selector`` (once; never after ``close``)."""
        if self.selector is None and self.reader.fileno() != -1:
            selector.register(self.reader, selectors.EVENT_READ, (self._drain, self._closed))
            self.selector = selector

    def wake(self) -> None:
        """Safe in a signal handler: a full socket means a wake-up is pending already."""
        with contextlib.suppress(OSError):
            self.writer.send(b"\0")

    def _drain(self, sock: socket.socket) -> bool:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            sock.recv(4096)
        return True  # keep watching

    def _closed(self, sock: socket.socket) -> None:
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(sock)
        self.selector = None

    def close(self) -> None:
        if self.selector is not None:
            self._closed(self.reader)
        self.reader.close()
        self.writer.close()
