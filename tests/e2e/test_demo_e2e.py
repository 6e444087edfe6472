"""The README's first command, as CI runs it: ``python -m devkit.demo --quick --json`` with no database
configured (a private embedded PostgreSQL) ends with a summary in which every task resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e


def test_quick_demo_resumes_every_task_and_prints_its_summary(tmp_path: Path) -> None:
    """Also ``--keep-running``: stdout is exactly the JSON summary, printed while the stack stays up, and the
    environment file it names points ``smart-triggerer status`` and ``dataset-bridge status`` at it."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != "SMART_TRIGGERER_DSN"
    }  # no database configured
    command = [sys.executable, "-m", "devkit.demo", "--quick", "--json", "--keep-running"]
    demo = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(demo.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        first = _read_line(demo, timeout=900)
        env_file = tmp_path / ".demo" / "env.sh"
        assert env_file.is_file() and env_file.stat().st_mode & 0o777 == 0o600
        status = _with_env(env_file, ["smart-triggerer", "status", "--json"])
        bridge = _with_env(env_file, ["dataset-bridge", "status", "--json"])
        demo.send_signal(signal.SIGTERM)  # the kept-running demo's Ctrl-C
        demo.wait(timeout=180)
        rest = demo.stdout.read()  # type: ignore[union-attr]
        reader.join(10)
    finally:
        _stop(demo)
    err = "".join(err_lines)
    assert demo.returncode == 0, f"demo exited {demo.returncode}:\n{err[-4000:]}"
    assert rest == "", rest  # stdout is the JSON line and nothing else: `| jq` works
    summary = json.loads(first)
    print(summary)
    assert summary["tasks"] == 40 and summary["resumed"] == summary["tasks"]
    assert summary["unique_waits"] == 10 and summary["dedup_ratio"] > 1
    assert summary["failures"] == 0 and summary["consumer_runs"] == 1
    assert 0 < summary["polls"] < summary["baseline_polls"]
    assert 0 <= summary["resume_p50_s"] <= summary["resume_p99_s"]
    assert "PostgreSQL: a private embedded PostgreSQL" in err
    assert status.returncode == 0, status.stderr[-2000:]
    assert sum(i["healthy"] for i in json.loads(status.stdout)["instances"]) == 2
    assert bridge.returncode == 0, bridge.stderr[-2000:]
    assert json.loads(bridge.stdout)["initialized"] is True
    assert not env_file.exists()  # removed with the stack
    # every process it started (Airflow components run in .demo/airflow, PostgreSQL in a temp dir) is gone
    assert _running_under(tmp_path) == []


def _stop(demo: subprocess.Popen[str]) -> None:
    """A demo still running (a failure, a timeout) is stopped as its user would (SIGTERM: it stops the stack
    it started, each component in a process group of its own); SIGKILL to its group only if it does not
    exit, which would leave those components behind."""
    if demo.poll() is not None:
        return
    demo.send_signal(signal.SIGTERM)
    try:
        demo.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line, or fail when the process exits first or ``timeout`` passes."""
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.append(process.stdout.readline()),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    reader.join(timeout)
    assert lines and lines[0], f"no summary line from the demo (exit code {process.poll()})"
    return lines[0]


def _with_env(env_file: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    bin_dir = Path(sys.executable).parent
    script = f'. "{env_file}" && exec "{bin_dir}/{argv[0]}" "$@"'
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    return subprocess.run(
        ["sh", "-c", script, "sh", *argv[1:]],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _running_under(root: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error):
            if Path(process.cwd()).is_relative_to(root):
                found.append(f"{process.pid} {process.info['name']}")
    return found
