"""The README's first command, as CI runs it: ``smart-triggerer demo --quick --json`` with no database
configured (a private embedded PostgreSQL) ends with a summary in which every task resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e


def test_quick_demo_resumes_every_task_and_prints_its_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AIRFLOW") and k != "SMART_TRIGGERER_DSN"}  # no database configured
    command = [str(Path(sys.executable).with_name("smart-triggerer")), "demo", "--quick", "--json"]
    demo = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = demo.communicate(timeout=900)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 0, f"demo exited {demo.returncode}:\n{err[-4000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    print(summary)
    assert summary["tasks"] == 40 and summary["resumed"] == summary["tasks"]
    assert summary["unique_waits"] == 10 and summary["dedup_ratio"] > 1
    assert summary["failures"] == 0 and summary["consumer_runs"] == 1
    assert 0 < summary["polls"] < summary["baseline_polls"]
    assert 0 <= summary["resume_p50_s"] <= summary["resume_p99_s"]
    assert "PostgreSQL: a private embedded PostgreSQL" in err
    # every process it started (Airflow components run in .demo/airflow, PostgreSQL in a temp dir) is gone
    assert _running_under(tmp_path) == []


def _running_under(root: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error):
            if Path(process.cwd()).is_relative_to(root):
                found.append(f"{process.pid} {process.info['name']}")
    return found
