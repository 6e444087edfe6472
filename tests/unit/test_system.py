"""What dev.py and the test workers change on the machine, under one lock (devkit/system.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devkit import system

HOLD = """
import sys, time
from devkit.system import machine_lock
with machine_lock():
    with open(sys.argv[1], "a") as out:
        out.write("in\\n"); out.flush(); time.sleep(0.3); out.write("out\\n")
"""


def test_processes_take_turns_under_the_machine_lock(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    root = Path(system.__file__).resolve().parents[1]
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, str(trace)], cwd=root) for _ in range(3)]
    assert [holder.wait(30) for holder in holders] == [0, 0, 0]
    assert trace.read_text().split() == ["in", "out"] * 3  # never two inside at once


def test_without_apt_the_error_names_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system.shutil, "which", lambda _name: None)  # type: ignore[attr-defined]
    with pytest.raises(system.SetupError, match="apt-get install chromium libfaketime"):
        system.apt_install(["chromium", "libfaketime"], "the UI test", print)


def test_libfaketime_configured_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMART_TRIGGERER_LIBFAKETIME", "/opt/faketime/libfaketime.so.1")
    assert system.ensure_libfaketime() == "/opt/faketime/libfaketime.so.1"


def test_the_machine_lock_is_reentrant_within_a_process() -> None:
    with system.machine_lock(), system.machine_lock():  # would wait on itself for ever
        assert system._depth[0] == 2
    assert system._depth[0] == 0


def test_a_lock_file_another_user_made_is_shared_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock needs no write access: a lock file this user may not append to is opened read-only, so
    root's runs and a user's take turns on the same file instead of running unlocked."""
    (tmp_path / system.LOCK_NAME).touch()
    opened = Path.open

    def not_ours(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "a":
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, mode, *args, **kwargs)

    monkeypatch.setattr(system, "LOCK_DIRS", (tmp_path,))
    monkeypatch.setattr(Path, "open", not_ours)
    handle = system._lock_file()
    assert handle is not None and handle.mode == "r"
    handle.close()


def test_a_package_that_cannot_be_installed_names_the_setting_to_point_at_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(system.FINDERS, "libfaketime", lambda: None)
    monkeypatch.setattr(system.shutil, "which", lambda _name: None)  # type: ignore[attr-defined]
    with pytest.raises(system.SetupError) as raised:
        system.ensure_libfaketime()
    assert "apt-get install libfaketime" in str(raised.value)
    assert str(raised.value).endswith("or set SMART_TRIGGERER_LIBFAKETIME")
