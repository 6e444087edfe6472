"""The runner's log channel gets a send buffer that holds thousands of lines (docs/design.md, runner: The
log channel)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import structlog

from smart_triggerer.runner.trigger_runner import BatchedLogChannel, batch_log_channel, widen_log_channel


class _Factory:  # the shape of Airflow's structlog LoggerFactory: its output is ``io``
    def __init__(self, io: object) -> None:
        self.io = io

    def __call__(self, *args: object) -> object:
        return structlog.PrintLogger()


class _BytesFactory(_Factory):
    def __call__(self, *args: object) -> object:
        return structlog.BytesLogger(self.io)  # type: ignore[arg-type]


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


class _CountingRaw:
    """A blocking channel that takes at most ``most`` bytes per write, as a socket may."""

    def __init__(self, most: int = 1 << 20) -> None:
        self.most = most
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: memoryview) -> int:
        taken = bytes(data[: self.most])
        self.writes.append(taken)
        return len(taken)

    def close(self) -> None:
        self.closed = True


def test_log_lines_go_out_in_one_write_per_drain() -> None:
    raw = _CountingRaw()
    channel = BatchedLogChannel(raw, limit=1 << 20)
    logger = structlog.BytesLogger(channel)  # type: ignore[arg-type]
    for n in range(100):
        logger.msg(f'{{"n": {n}}}'.encode())
    assert raw.writes == []  # structlog's flush after each line sends nothing
    channel.drain()
    assert len(raw.writes) == 1
    assert raw.writes[0].splitlines() == [f'{{"n": {n}}}'.encode() for n in range(100)]
    channel.drain()
    assert len(raw.writes) == 1  # nothing pending, no write


def test_a_full_batch_goes_at_once_and_partial_writes_are_completed() -> None:
    raw = _CountingRaw(most=7)
    channel = BatchedLogChannel(raw, limit=20)
    channel.write(b"0123456789\n")
    assert raw.writes == []
    channel.write(b"abcdefghij\n")  # 22 bytes waiting: over the limit
    assert b"".join(raw.writes) == b"0123456789\nabcdefghij\n" and len(raw.writes) == 4
    channel.write(b"last\n")
    channel.close()
    assert b"".join(raw.writes).endswith(b"last\n") and raw.closed


def test_loggers_made_after_the_swap_write_through_the_batch(restored_structlog: None) -> None:
    runner_end, supervisor_end = socket.socketpair()
    with runner_end, supervisor_end:
        log_io = os.fdopen(os.dup(runner_end.fileno()), "wb", buffering=0)
        structlog.configure(
            logger_factory=_BytesFactory(log_io),
            cache_logger_on_first_use=False,
            processors=[lambda _logger, _method, event: str(event["event"]).encode()],
        )
        channel = batch_log_channel()
        assert isinstance(channel, BatchedLogChannel) and channel.raw is log_io
        assert batch_log_channel() is channel  # once only
        structlog.get_logger().msg("one")
        structlog.get_logger().msg("two")
        supervisor_end.setblocking(False)
        with pytest.raises(BlockingIOError):
            supervisor_end.recv(64)  # nothing sent before the drain
        channel.close()
        supervisor_end.setblocking(True)
        assert supervisor_end.recv(64) == b"one\ntwo\n"


def test_a_line_logged_while_the_channel_drains_on_the_same_thread_neither_hangs_nor_splits() -> None:
    """A garbage collector's finalizer or a signal handler can log on the thread that is inside ``drain``
    (holding the channel's lock): with a plain lock that thread waited on itself for ever, and the runner
    with it. The late line must go out after the batch being written, whole."""
    import threading

    class _Raw:
        def __init__(self) -> None:
            self.written = bytearray()
            self.channel: BatchedLogChannel | None = None

        def write(self, data: memoryview) -> int:
            part = min(len(data), 5)  # a socket may take part of a batch
            self.written += data[:part]
            if self.channel is not None and len(self.written) == 5:
                self.channel.write(b"late line\n")  # as a finalizer would, mid-batch
            return part

    raw = _Raw()
    channel = BatchedLogChannel(raw, limit=10)
    raw.channel = channel
    done = threading.Event()

    def log_and_drain() -> None:
        channel.write(b"first line\n")  # over the limit: drains at once
        channel.drain()
        done.set()

    threading.Thread(target=log_and_drain, daemon=True).start()
    assert done.wait(5), "the channel's own thread waited on itself"
    assert bytes(raw.written) == b"first line\nlate line\n"
