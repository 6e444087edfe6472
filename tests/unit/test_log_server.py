"""The trigger log server beside an instance (``smart_triggerer.supervisor.service.log_server``), as ``airflow
triggerer`` runs it, and not even imported when skipped. Each case runs in a process of its own: what is
imported is the question, and the server is a process that must not outlive its test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

from devkit.pgserver import free_port

ROOT = Path(__file__).resolve().parents[2]

SKIPPED = """
import sys
from smart_triggerer.supervisor.service import log_server
with log_server(True):
    pass
print("imported" if "airflow.utils.serve_logs" in sys.modules else "not imported")
"""

SERVED = """
import socket, sys, time
from smart_triggerer.supervisor.service import log_server

def accepts(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False

port = int(sys.argv[1])
with log_server(False):
    deadline = time.monotonic() + 90
    while not accepts(port):
        if time.monotonic() > deadline:
            sys.exit("the log server did not listen")
        time.sleep(0.1)
    print("listening", flush=True)
deadline = time.monotonic() + 30
while accepts(port):  # terminated on the way out, as Airflow's triggerer command does
    if time.monotonic() > deadline:
        sys.exit("the log server outlived the instance")
    time.sleep(0.1)
print("stopped")
"""


def run(code: str, tmp_path: Path, *args: str, **settings: str) -> str:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__API__SECRET_KEY": "test-secret",
        "PYTHONPATH": str(ROOT),
        **settings,
    }
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=180)
    finally:  # the process and the log server it started, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 0, err[-3000:]
    return out


def test_a_skipped_log_server_is_not_imported(tmp_path: Path) -> None:
    assert run(SKIPPED, tmp_path).splitlines()[-1] == "not imported"


def test_the_log_server_listens_while_the_instance_runs_and_stops_with_it(tmp_path: Path) -> None:
    port = free_port()
    out = run(SERVED, tmp_path, str(port), AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(port))
    # the server's own log lines come on the same output
    assert [line for line in out.splitlines() if line in ("listening", "stopped")] == ["listening", "stopped"]
