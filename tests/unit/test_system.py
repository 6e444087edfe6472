"""What dev.py and the test workers change on the machine, under one lock (devkit/system.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    monkeypatch.setattr(system.shutil, "which", lambda _name: None)
    with pytest.raises(system.SetupError, match="apt-get install chromium libfaketime"):
        system.apt_install(["chromium", "libfaketime"], "the UI test", print)


def test_libfaketime_configured_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMART_TRIGGERER_LIBFAKETIME", "/opt/faketime/libfaketime.so.1")
    assert system.ensure_libfaketime() == "/opt/faketime/libfaketime.so.1"
