"""A PostgreSQL server whose clock can be stepped forward while it runs (libfaketime), and the arithmetic
that takes such steps back out of durations measured on that clock.

The chaos run's embedded server starts with ``LD_PRELOAD`` of Debian's ``libfaketime`` and an offset read
from a file on every clock read (``FAKETIME_NO_CACHE=1``): writing a larger offset into the file steps the
wall clock of every backend at once, as an NTP step or a VM migration would (``now()``,
``clock_timestamp()``, the server's own timeouts). ``CLOCK_MONOTONIC`` is left alone, as a real step
leaves it. Only the server is affected: the triggerers, the harness and the other processes keep the
host's clock. Steps go forward only: the database's clock going back is what a failover to a replica
does, and the triggerer's answer to that (transaction ids going back) is tested apart.

``libfaketime`` is installed when missing (``devkit.system.ensure_libfaketime``: ``apt-get``, as root or
through passwordless sudo; ``dev.py test`` installs it up front with Chromium).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devkit.pgserver import EmbeddedPostgres


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the server process is spawned (it inherits them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class FakeClockPostgres(EmbeddedPostgres):
    """An embedded PostgreSQL whose wall clock is the host's plus ``offset`` seconds (0 at first)."""

    library: str = ""
    offset: float = 0.0
    _offset_file: Path | None = field(default=None, repr=False)

    @property
    def offset_file(self) -> Path:
        if self._offset_file is None:
            folder = self.data_dir.parent / "clock"
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)  # read by the server's unprivileged user
            self._offset_file = folder / "offset"
            self._write_offset(self.offset)
        return self._offset_file

    def start(self, timeout: float = 30.0) -> None:
        with _environment(
            {
                "LD_PRELOAD": self.library,
                "FAKETIME_TIMESTAMP_FILE": str(self.offset_file),
                "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        ):
            super().start(timeout)

    def step(self, seconds: float) -> ClockStep:
        """Move the server's clock ``seconds`` forward now; returns the step in the server's time."""
        if seconds <= 0:
            raise ValueError("only forward steps: a clock going back is a failover's business")
        at = dt.datetime.now(dt.UTC)
        before = at + dt.timedelta(seconds=self.offset)
        self.offset += seconds
        self._write_offset(self.offset)
        return ClockStep(before, before + dt.timedelta(seconds=seconds))

    def _write_offset(self, offset: float) -> None:
        assert self._offset_file is not None
        staged = self._offset_file.with_suffix(".new")
        staged.write_text(f"{offset:+.6f}\n")
        staged.chmod(0o644)
        os.replace(staged, self._offset_file)  # each clock read sees the old offset or the new one


@dataclass(frozen=True)
class ClockStep:
    """The server's clock jumped from ``before`` to ``after`` (its own readings) at one instant."""

    before: dt.datetime
    after: dt.datetime


def continuous(moment: dt.datetime, steps: Sequence[ClockStep]) -> dt.datetime:
    """A reading of the stepped clock as the same instant on a clock that never stepped (the host's).

    A reading after a step loses that step's size; a moment inside a skipped stretch (a deadline the
    step jumped over) is the instant of the step. Durations between two mapped readings are real time.
    """
    shift = dt.timedelta(0)
    for step in sorted(steps, key=lambda s: s.before):
        if moment >= step.after:
            shift += step.after - step.before
        elif moment > step.before:
            return step.before - shift
        else:
            break
    return moment - shift
