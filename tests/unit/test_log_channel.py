"""The runner's log channel gets a send buffer that holds thousands of lines (triggerer/runner.py, item 6)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import structlog

from triggerer.runner import widen_log_channel


class _Factory:  # the shape of Airflow's structlog LoggerFactory: its output is ``io``
    def __init__(self, io: object) -> None:
        self.io = io

    def __call__(self, *args: object) -> object:
        return structlog.PrintLogger()


@pytest.fixture
def restored_structlog() -> Iterator[None]:
    config = structlog.get_config()
    yield
    structlog.configure(**config)


def test_the_channel_socket_gets_a_wider_send_buffer_and_stays_open(restored_structlog: None) -> None:
    runner_end, supervisor_end = socket.socketpair()
    with runner_end, supervisor_end:
        before = runner_end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        log_io = os.fdopen(os.dup(runner_end.fileno()), "wb", buffering=0)  # as Airflow opens its log fd
        with log_io:
            structlog.configure(logger_factory=_Factory(log_io))
            wanted = 2 * before
            assert widen_log_channel(wanted) == runner_end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            assert runner_end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > before
            log_io.write(b"still open\n")  # only the duplicate the widening made was closed
            assert supervisor_end.recv(64) == b"still open\n"


def test_a_channel_that_is_no_socket_is_left_alone(restored_structlog: None) -> None:
    structlog.configure(logger_factory=_Factory(None))
    assert widen_log_channel() is None
    with open(os.devnull, "wb") as not_a_socket:
        structlog.configure(logger_factory=_Factory(not_a_socket))
        assert widen_log_channel() is None
