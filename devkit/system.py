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
LIBFAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
)
# /run/lock is the system's place for lock files (world-writable, emptied at boot)
LOCK_DIRS = (Path("/run/lock"), Path(tempfile.gettempdir()))
LOCK_NAME = ".airflow-smart-triggerer-setup.lock"


class SetupError(RuntimeError):
    """A package or user the tests need is missing and could not be added here."""


_depth = [0]  # machine_lock's depth in this process: a nested call must not wait on its own lock


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while this process changes the machine; other processes of ours wait for it. Reentrant within
    a process (flock on a second open of the file would wait on the first for ever)."""
    if _depth[0]:
        with _deeper():
            yield
        return
    handle = _lock_file()
    if handle is None:
        print(
            f"warning: no lock file could be opened ({', '.join(str(d / LOCK_NAME) for d in LOCK_DIRS)}): "
            "changing the machine without a lock",
            file=sys.stderr,
        )
        with _deeper():
            yield
        return
    with handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)
        with _deeper():
            yield


@contextlib.contextmanager
def _deeper() -> Iterator[None]:
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


def _lock_file() -> IO[str] | None:
    """The lock file, made when missing; one another user made is opened read-only (flock needs no write
    access), so root, sudo and a user's runs all take turns on the same file."""
    for folder in LOCK_DIRS:
        for mode in ("a", "r"):
            try:
                return (folder / LOCK_NAME).open(mode)
            except OSError:
                continue  # missing folder, read-only, or the file is another user's
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
    # sudo resets the environment: the non-interactive front end is passed through env
    apt_env = [*sudo, "env", "DEBIAN_FRONTEND=noninteractive", apt] if sudo else [apt]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # dpkg's lock, held by an apt run that is not ours (ours take turns under machine_lock), is waited for
    wait = ["-o", "DPkg::Lock::Timeout=300"]
    for command in (
        [*apt_env, *wait, "update"],
        [*apt_env, *wait, "install", "-y", "--no-install-recommends", *packages],
    ):
        result = subprocess.run(command, env=env, stdout=sys.stderr.fileno(), check=False)
        if result.returncode != 0:
            raise SetupError(
                f"{' '.join(command)} failed ({result.returncode}), see its output above; "
                f"{why}: install {names} by hand"
            )


FINDERS: dict[str, Callable[[], str | None]] = {"chromium": find_chromium, "libfaketime": find_libfaketime}
SETTINGS = {"chromium": "SMART_TRIGGERER_CHROMIUM", "libfaketime": "SMART_TRIGGERER_LIBFAKETIME"}


def ensure_packages(packages: list[str], why: str, log: Callable[[str], None] = print) -> dict[str, str]:
    """Each package's path (``FINDERS``), the missing ones installed first in one apt run; looked for again
    under the machine lock, as another worker may have installed them meanwhile. SetupError otherwise,
    naming the settings that point at a copy installed elsewhere."""

    def missing() -> list[str]:
        return [name for name in packages if not FINDERS[name]()]

    def settings(names: list[str]) -> str:
        return " / ".join(SETTINGS[name] for name in names)

    if missing():
        with machine_lock():
            if wanted := missing():
                try:
                    apt_install(wanted, why, log)
                except SetupError as error:
                    raise SetupError(f"{error}; or set {settings(wanted)}") from None
    if still := missing():
        raise SetupError(f"{' '.join(still)} installed but not found; set {settings(still)}")
    return {name: str(FINDERS[name]()) for name in packages}


def ensure_libfaketime(log: Callable[[str], None] = print) -> str:
    """The path of libfaketime.so.1, installing Debian's package first when it is missing."""
    return ensure_packages(["libfaketime"], "the chaos run steps the database's clock with libfaketime", log)[
        "libfaketime"
    ]
