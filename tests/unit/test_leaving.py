"""A stopping instance yields the CPU once its leases are released (smart_triggerer/supervisor/service.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, subprocess, sys, threading
from smart_triggerer.supervisor.service import LEAVING_NICENESS, yield_cpu
probe = subprocess.Popen(["sleep", "30"])
try:  # a sandbox may refuse any change of priority: then there is nothing to lower, and no error
    os.setpriority(os.PRIO_PROCESS, probe.pid, 1)
    refused = ""
except OSError as error:
    refused = f"{type(error).__name__}: {error}"
finally:
    probe.kill()
    probe.wait()
runner = subprocess.Popen(["sleep", "30"])
done = threading.Event()
worker = threading.Thread(target=done.wait)  # a thread of the supervisor's (health, page): lowered too
worker.start()
try:
    yield_cpu(runner.pid)
    if refused:
        print("refused", refused)
        sys.exit(0)
    # thread ids as the kernel gives them to this process (/proc may number them otherwise in a sandbox)
    threads = {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}
    assert threads == {LEAVING_NICENESS}, threads
    print(os.getpriority(os.PRIO_PROCESS, runner.pid), os.getpriority(os.PRIO_PROCESS, 0), LEAVING_NICENESS)
    try:  # "/autogroup-N nice V"; absent without autogroups, empty in some sandboxes
        fields = open("/proc/self/autogroup").read().split()
    except OSError:
        fields = []
    print(fields[-1] if fields else "-")
finally:
    done.set()
    runner.kill()
    runner.wait()
yield_cpu(runner.pid)  # the runner is gone: nothing to do, no error
"""


def leave(*, own_session: bool) -> tuple[int, int, int, str]:
    # in a child process: a test process that lowered its own priority could not raise it again
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=own_session,
    )
    assert child.returncode == 0, f"the leaving child failed ({child.returncode}):\n{child.stderr}"
    if "refused" in child.stdout:
        pytest.skip(
            f"this host refuses any change of priority ({child.stdout.strip()}): yield_cpu lowers "
            "nothing here and raised nothing"
        )
    out = child.stdout.split()
    runner, supervisor, wanted = (int(v) for v in out[-4:-1])
    return runner, supervisor, wanted, out[-1]


def test_the_leaving_supervisor_and_its_runner_drop_to_the_lowest_priority() -> None:
    runner, supervisor, wanted, _ = leave(own_session=False)
    assert wanted == 19 and runner == wanted and supervisor == wanted


def test_an_instance_in_a_session_of_its_own_lowers_its_sessions_share_too() -> None:
    """Linux shares the CPU between sessions (autogroups) before nice values count; a session shared
    with others (the taker's, a shell's) keeps its share."""
    *_, own = leave(own_session=True)
    *_, shared = leave(own_session=False)
    if own == "-":  # the child ran without error; there is no share to lower here
        pytest.skip("this host shows no autogroup nice value (/proc/self/autogroup absent or empty)")
    assert own == "19"
    # this test's session: untouched. A sandbox may show an empty file for the session it starts in and
    # a readable one for a session made inside it: then there is nothing to compare.
    ours = _autogroup_nice()
    assert shared == ours or "-" in (shared, ours), (shared, ours)


def _autogroup_nice() -> str:
    try:
        fields = Path("/proc/self/autogroup").read_text().split()
    except OSError:
        return "-"
    return fields[-1] if fields else "-"


def _in_pid_namespace(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a PID namespace of its own whose /proc is the host's (not mounted again), as in some
    sandboxes: /proc gives thread ids in numbers this process does not use."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command (util-linux) on this host: no PID namespace to run in")
    for flags in (["--pid", "--fork"], ["--user", "--map-root-user", "--pid", "--fork"]):
        child = subprocess.run(
            ["unshare", *flags, sys.executable, "-c", code],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if not child.stderr.startswith("unshare:"):
            return child
    pytest.skip(f"this host makes no PID namespace: {child.stderr.strip()}")


def test_where_proc_numbers_threads_otherwise_every_python_thread_is_lowered() -> None:
    probe = _in_pid_namespace(
        "from smart_triggerer.supervisor.service import _proc_is_ours; print(_proc_is_ours())"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["False"]  # the numbering differs there: the case under test

    child = _in_pid_namespace(CHILD)
    assert child.returncode == 0, f"the leaving child failed ({child.returncode}):\n{child.stderr}"
    if "refused" in child.stdout:
        pytest.skip(f"the namespace refuses any change of priority ({child.stdout.strip()})")
    runner, supervisor, wanted = (int(v) for v in child.stdout.split()[-4:-1])
    assert wanted == 19 and runner == wanted and supervisor == wanted
