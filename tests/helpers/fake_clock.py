"""A PostgreSQL server whose clock can be stepped forward while it runs (libfaketime), and the arithmetic
that takes such steps back out of durations measured on that clock.

The chaos run's embedded server starts with ``LD_PRELOAD`` of Debian's ``libfaketime`` and an offset read
from a file on every clock read (``FAKETIME_NO_CACHE=1``): writing a larger offset into the file steps the
wall clock of every backend at once, as an NTP step or a VM migration would (``now()``,
``clock_timestamp()``, the server's own timeouts). ``CLOCK_MONOTONIC`` is left alone, as a real step
leaves it. Only the server is affected: the triggerers, the harness and the other processes keep the
host's clock. Steps go forward only: the database's clock going back is what a failover to a replica
does, and the triggerer's answer to that (transaction ids going back) is tested apart.

``libfaketime`` is installed when missing the way ``dev.py`` installs Chromium (``apt-get``, as root or
through passwordless sudo).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devkit.pgserver import EmbeddedPostgres

LIBRARY_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                 "/usr/lib64/faketime/libfaketime.so.1")
PACKAGE = "libfaketime"


class FakeClockUnavailable(RuntimeError):
    """libfaketime is not installed and could not be installed here."""


def find_libfaketime() -> str | None:
    if configured := os.environ.get("SMART_TRIGGERER_LIBFAKETIME"):
        return configured
    return next((found for pattern in LIBRARY_GLOBS for found in sorted(glob.glob(pattern))), None)


def ensure_libfaketime(log: Callable[[str], None] = print) -> str:
    """The path of libfaketime.so.1, installing Debian's package first when it is missing."""
    found = find_libfaketime()
    if found:
        return found
    apt = shutil.which("apt-get")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if apt is None or sudo is None:
        raise FakeClockUnavailable("the chaos run steps the database's clock with libfaketime: install your "
                                   "system's libfaketime package (Debian: apt-get install libfaketime), or "
                                   "set SMART_TRIGGERER_LIBFAKETIME to libfaketime.so.1")
    log(f"installing {PACKAGE} for the database clock steps (apt-get install {PACKAGE})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in ([*sudo, apt, "update"],
                    [*sudo, apt, "install", "-y", "--no-install-recommends", PACKAGE]):
        result = subprocess.run(command, env=env, stdout=sys.stderr.fileno(), check=False)
        if result.returncode != 0:
            raise FakeClockUnavailable(f"{' '.join(command)} failed ({result.returncode}); see its output")
    found = find_libfaketime()
    if not found:
        raise FakeClockUnavailable(f"{PACKAGE} was installed but libfaketime.so.1 is not in {LIBRARY_GLOBS}")
    return found


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
        with _environment({"LD_PRELOAD": self.library, "FAKETIME_TIMESTAMP_FILE": str(self.offset_file),
                           "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}):
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

