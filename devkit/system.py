"""What the tests need from the machine beyond Python: Debian packages (Chromium for the UI test,
libfaketime for the database clock steps) and the unprivileged user the embedded PostgreSQL runs as.

Standard library only: ``dev.py`` imports it with the system's Python, before the virtualenv exists.
Every step that changes the machine runs under one lock (``machine_lock``): the test workers
(pytest-xdist) start at once, and on a new machine two of them ran ``apt-get`` together (the second failed
on apt's lock) or ``useradd`` together (two users' entries written over each other, so one worker ran
``initdb`` as a uid that no longer existed).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")
LIBFAKETIME_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                     "/usr/lib64/faketime/libfaketime.so.1")
# /run/lock is the system's place for lock files (world-writable, emptied at boot)
LOCK_DIRS = (Path("/run/lock"), Path(tempfile.gettempdir()))
LOCK_NAME = ".airflow-smart-triggerer-setup.lock"


class SetupError(RuntimeError):
    """A package or user the tests need is missing and could not be added here."""


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while this process changes the machine; other processes of ours wait for it."""
    handle = _lock_file()
    if handle is None:  # nowhere to lock (another user's lock file): this user's runs still take turns
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_file() -> IO[str] | None:
    for folder in LOCK_DIRS:
        try:
            return (folder / LOCK_NAME).open("a")
        except OSError:
            continue  # missing, read-only, or the file belongs to another user
    return None


def find_chromium() -> str | None:
    """The system's Chromium (SMART_TRIGGERER_CHROMIUM, else on PATH)."""
    if configured := os.environ.get("SMART_TRIGGERER_CHROMIUM"):
        return configured
    return next((found for name in CHROMIUM_CANDIDATES if (found := shutil.which(name))), None)


def find_libfaketime() -> str | None:
    """libfaketime.so.1 (SMART_TRIGGERER_LIBFAKETIME, else Debian's package)."""
    if configured := os.environ.get("SMART_TRIGGERER_LIBFAKETIME"):
        return configured
    return next((found for pattern in LIBFAKETIME_GLOBS for found in sorted(glob.glob(pattern))), None)


def apt_install(packages: list[str], why: str, log: Callable[[str], None]) -> None:
    """Install Debian packages (as root, or through passwordless sudo); one ``apt-get update`` for all.

    Their output goes to stderr; a failure raises SetupError saying what to install by hand.
    """
    apt = shutil.which("apt-get")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    names = " ".join(packages)
    if apt is None or sudo is None:
        raise SetupError(f"{why}: install your system's {names} package(s) (Debian: apt-get install {names})")
    log(f"installing {names} ({why}): apt-get install {names}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # apt's own lock (another apt run on this machine, not ours) is waited for rather than failed on
    wait = ["-o", "DPkg::Lock::Timeout=300"]
    for command in ([*sudo, apt, *wait, "update"],
                    [*sudo, apt, *wait, "install", "-y", "--no-install-recommends", *packages]):
        result = subprocess.run(command, env=env, stdout=sys.stderr.fileno(), check=False)
        if result.returncode != 0:
            raise SetupError(f"{' '.join(command)} failed ({result.returncode}); see its output above")


def ensure_libfaketime(log: Callable[[str], None] = print) -> str:
    """The path of libfaketime.so.1, installing Debian's package first when it is missing."""
    with machine_lock():
        found = find_libfaketime()
        if not found:
            apt_install(["libfaketime"], "the chaos run steps the database's clock with libfaketime", log)
            found = find_libfaketime()
    if not found:
        raise SetupError(f"libfaketime was installed but libfaketime.so.1 is not in {LIBFAKETIME_GLOBS}")
    return found
